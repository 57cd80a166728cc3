"""Single-key bounds, declared beside each schema field (rlflow.recipe.bounds) and reported by
one rule; the rules of rlflow.rules.checks, each listed once and none hiding another."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe import inert, schema
from rlflow.recipe.bounds import Bound, bound, bounded_values
from rlflow.rules import checks, elsewhere, load_checked, partial

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"


def schema_fields():
    for _, cls in inspect.getmembers(schema, dataclasses.is_dataclass):
        if cls.__module__ != schema.__name__:
            continue
        for field in dataclasses.fields(cls):
            yield cls, field


def errors(overrides: list[str]) -> list[Diagnostic]:
    with pytest.raises(RlflowError) as caught:
        load_checked(TINY, overrides)
    return [d for d in caught.value.diagnostics if d.severity == "error"]


def test_no_schema_field_has_a_default_in_code():
    """A bound adds metadata, never a default: defaults live in recipes/base.yaml only."""
    for cls, field in schema_fields():
        assert field.default is dataclasses.MISSING, f"{cls.__name__}.{field.name}"
        assert field.default_factory is dataclasses.MISSING, f"{cls.__name__}.{field.name}"


def test_every_bound_has_a_known_code():
    bounds = [f.metadata["bound"] for _, f in schema_fields() if "bound" in f.metadata]
    assert len(bounds) > 40
    for b in bounds + [b.keys for b in bounds if b.keys]:
        Diagnostic(b.code, "x")  # asserts the code's category exists


@pytest.mark.parametrize(
    "override, code, message, help",
    [
        ("generation.top_p=1.5", "recipe.range", "`generation.top_p` must be in (0, 1] (it is 1.5)", None),
        ("generation.top_k=-1", "recipe.range", "`generation.top_k` must not be negative (it is -1)", "0 disables top-k"),
        ("grpo.max_val_samples=0", "recipe.range", "`grpo.max_val_samples` must be at least 1 (it is 0)", None),
        ("optimizer.lr=0", "recipe.range", "`optimizer.lr` must be positive (it is 0)", None),
        ("loss.ratio_clip_low=1", "recipe.range", "`loss.ratio_clip_low` must be in [0, 1) (it is 1)", "the ratio is clipped to [1 - low, 1 + high]"),
        ("cluster.num_nodes=0", "recipe.range", "`cluster.num_nodes` must be at least 1 (it is 0)", "or null: `rlflow submit` fills it"),
        ("data.mix={clevr: -1}", "recipe.range", "`data.mix.clevr` must not be negative (it is -1)", None),
        ("slurm.env={1BAD: x}", "recipe.env-name", "`slurm.env.1BAD` is not a valid environment variable name", "use letters, digits and underscores, not starting with a digit"),
        ("generation.vllm.cpu.python=3.1", "recipe.vllm-python", "`generation.vllm.cpu.python` is '3.1', not a Python 3.8+ version", None),
        ("generation.vllm.cuda.packages=[]", "recipe.range", "`generation.vllm.cuda.packages` is empty", None),
        ("slurm.rlflow_command=' '", "recipe.rlflow-command", "`slurm.rlflow_command` is empty", None),
        ("slurm.time_limit=1h", "recipe.time-limit", "`slurm.time_limit` is '1h', which Slurm does not read as a time: use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS", None),
        ("slurm.container_image=''", "submit.container", "`slurm.container_image` is empty", "set an image, or null to run on the host"),
    ],
)  # fmt: skip
def test_a_value_outside_its_bound_names_the_key_and_the_value(override, code, message, help):
    (problem,) = errors([override])
    assert (problem.code, problem.message) == (code, message)
    if help is not None:
        assert problem.help == help
    assert problem.file == f"command line `{override}`"


def test_one_rule_reports_every_bound_at_once():
    found = errors(["generation.top_p=0", "checkpointing.keep_last=0", "data.max_objects=0"])
    assert [d.message.split("`")[1] for d in found] == [
        "data.max_objects",
        "generation.top_p",
        "checkpointing.keep_last",
    ]


def test_a_new_bound_is_one_annotation():
    """What a new single-key bound costs: `field(metadata=bound(...))` on the field, nothing else."""

    @dataclasses.dataclass(frozen=True)
    class Section:
        size: int = dataclasses.field(metadata=bound(ge=1, le=8, help="a power of two"))
        names: list[str] = dataclasses.field(metadata=bound(pattern=r"[a-z]+", says="is {value}"))
        free: float

    section = Section(size=9, names=["ok", "Not"], free=-1.0)
    found = [(name, b.problem(v)) for _, name, v, b in bounded_values(section, ("x",))]
    assert [(n, p) for n, p in found if p] == [
        ("x.size", "must be in [1, 8] (it is 9)"),
        ("x.names[1]", "is 'Not'"),
    ]
    assert Bound(nonempty=True).problem([]) == "is empty"


def _rule_names() -> set[str]:
    return {rule.__name__ for rule in checks.RULES}


def test_every_rule_is_listed_once_and_none_calls_another():
    """`RULES` is the whole list: each function that takes the loaded recipe is in it once, and
    no rule runs another one in its body or its `return` (no hidden sub-rules)."""
    functions = {
        n.name: n
        for module in (checks, elsewhere, inert, partial)
        for n in ast.parse(Path(module.__file__).read_text()).body
        if isinstance(n, ast.FunctionDef)
    }
    takes_recipe = {
        name
        for name, node in functions.items()
        if [a.arg for a in node.args.args] == ["loaded"] and name != "check_recipe"
    }
    assert len(checks.RULES) == len(_rule_names())
    assert takes_recipe == _rule_names()
    for name in _rule_names():
        called = {
            n.func.id
            for n in ast.walk(functions[name])
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert not called & _rule_names(), f"{name} runs {called & _rule_names()}"
