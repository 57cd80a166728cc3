"""The loader keeps the text written: every "values silently rewritten", "non-finite numbers
pass" and "tracebacks at load" case of issue 15, each an error with file and key (exit 2) or
the exact value; and the resolved recipe reads back as itself."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.errors import RlflowError
from rlflow.recipe import load as load_module
from rlflow.recipe.load import dump_recipe, load_recipe
from rlflow.rules import load_checked

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "recipes" / "base.yaml"
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"


def recipe(tmp_path: Path, body: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"defaults: {BASE}\n{body}")
    return path


def errors(path: Path, overrides: list[str] = ()) -> list:
    with pytest.raises(RlflowError) as caught:
        load_checked(path, overrides)
    assert caught.value.exit_code == 2
    return caught.value.diagnostics


def only(path: Path, overrides: list[str] = ()):
    (problem,) = errors(path, overrides)
    return problem


@pytest.mark.parametrize(
    "value, readings",
    [
        ("12:00:00", "the number 43200 (YAML 1.1, base 60)"),
        ("4:00:00", "the number 14400 (YAML 1.1, base 60)"),
    ],
)
def test_unquoted_time_limit_is_refused_with_both_readings(tmp_path, value, readings):
    path = recipe(tmp_path, f"slurm:\n  time_limit: {value}\n")
    problem = only(path)
    assert problem.code == "recipe.ambiguous"
    assert problem.message == (
        f"`slurm.time_limit` is {value} without quotes, which YAML reads as {readings}"
    )
    assert problem.file.endswith("r.yaml") and problem.line == 3
    assert problem.help.startswith(f"did you mean '{value}'? write it in quotes")
    from_the_command_line = only(TINY, [f"slurm.time_limit={value}"])
    assert from_the_command_line.file == f"command line `slurm.time_limit={value}`"
    assert from_the_command_line.help == (
        f"did you mean '{value}'? quote it inside the shell's quotes: "
        f"'slurm.time_limit=\"{value}\"'"
    )


def test_quoted_time_limit_is_kept_exactly(tmp_path):
    assert (
        load_checked(recipe(tmp_path, 'slurm:\n  time_limit: "12:00:00"\n')).recipe.slurm.time_limit
        == "12:00:00"
    )
    assert load_checked(TINY, ["slurm.time_limit='4:00:00'"]).recipe.slurm.time_limit == "4:00:00"
    assert load_checked(TINY, ["slurm.time_limit=00:30:00"]).recipe.slurm.time_limit == "00:30:00"


@pytest.mark.parametrize(
    "override, key, readings",
    [
        ("slurm.mem=010", "slurm.mem", "the number 10 (YAML 1.2) or 8 (YAML 1.1, octal)"),
        ("slurm.env={A: 1.10}", "slurm.env.A", "the number 1.1"),
        ("slurm.env={A: 0123}", "slurm.env.A", "the number 123 (YAML 1.2) or 83 (YAML 1.1, octal)"),
        ("slurm.qos=1e3", "slurm.qos", "the number 1000.0 (YAML 1.2)"),
        ("slurm.account=0o17", "slurm.account", "the number 15 (YAML 1.2)"),
    ],
)
def test_numbers_that_read_differently_in_string_keys_are_refused(override, key, readings):
    problem = only(TINY, [override])
    assert problem.code == "recipe.ambiguous"
    assert f"`{key}` is " in problem.message and problem.message.endswith(readings)


def test_string_values_are_kept_exactly(tmp_path):
    path = recipe(
        tmp_path,
        'slurm:\n  mem: "010"\n  env: {A: "1.10", B: "0123", C: 5, D: 3.11, E: yes, F: "#x"}\n'
        "  partition: gpu#1\n",
    )
    slurm = load_checked(path).recipe.slurm
    assert slurm.mem == "010" and slurm.partition == "gpu#1"
    assert slurm.env == {"A": "1.10", "B": "0123", "C": "5", "D": "3.11", "E": "yes", "F": "#x"}


@pytest.mark.parametrize(
    "value", ["#gpu", "*gpu", "&gpu", "!gpu", "gpu #1", "|", "- a", "%x", "{question}?", "a [b]"]
)
def test_override_values_are_plain_text(value):
    assert load_checked(TINY, [f"run.name={value}"]).recipe.run.name == value


def test_override_flow_value_with_a_comment_is_refused():
    problem = only(TINY, ["slurm.extra_sbatch_args=[--exclusive, #x]"])
    assert "YAML reads ` #` as the start of a comment" in problem.help


@pytest.mark.parametrize(
    "override, key",
    [
        ("optimizer.lr=.nan", "optimizer.lr"),
        ("rewards.format=.nan", "rewards.format"),
        ("loss.kl_penalty=.nan", "loss.kl_penalty"),
        ("loss.kl_penalty=-.inf", "loss.kl_penalty"),
        ("optimizer.adam_eps=1e999", "optimizer.adam_eps"),
        ("data.video.fps=.inf", "data.video.fps"),
        ("optimizer.lr='.nan'", "optimizer.lr"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_key(override, key):
    problem = only(TINY, [override])
    assert problem.code == "recipe.non-finite"
    assert problem.message.startswith(f"`{key}` is ")
    assert "must be finite" in problem.message


def test_non_finite_number_in_a_file_names_file_and_line(tmp_path):
    problem = only(recipe(tmp_path, "loss:\n  kl_penalty: .NaN\n"))
    assert problem.code == "recipe.non-finite" and problem.line == 3
    assert problem.file.endswith("r.yaml")


@pytest.mark.parametrize("text", ["", "# only a comment\n\n# and another\n", "---\n"])
def test_empty_recipe_says_so(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    problem = only(path)
    assert problem.code == "recipe.empty" and problem.file.endswith("empty.yaml")
    assert "defaults: base.yaml" in problem.help


def test_recipe_without_defaults_names_what_is_missing(tmp_path):
    path = tmp_path / "alone.yaml"
    path.write_text("grpo:\n  max_num_steps: 3\n")
    found = errors(path)
    assert all(p.code == "recipe.missing-key" for p in found)
    assert all(p.file and p.file.endswith("alone.yaml") for p in found)
    assert any("`run`, `model`, `data`" in p.message for p in found)


@pytest.mark.parametrize(
    "body, code",
    [
        ("a: &x [*x]\n", "recipe.yaml-alias"),
        (
            "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
            + "".join(
                f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
            ),
            "recipe.yaml-alias",
        ),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "recipe.yaml-depth"),
        ("a: " + "{b: " * 5000 + "1" + "}" * 5000 + "\n", "recipe.yaml-depth"),
        ("run:\n  name: !!python/object/apply:os.system [true]\n", "recipe.yaml-tag"),
        ("run: {name: a}\n---\nrun: {name: b}\n", "recipe.yaml"),
        ("run:\n  name: 'unbalanced\n", "recipe.yaml"),
        ("[1, 2]\n", "recipe.not-a-mapping"),
        ("run:\n  ? [a]\n  : b\n", "recipe.yaml-key"),
    ],
    ids=[
        "self-alias",
        "alias-bomb",
        "deep-list",
        "deep-map",
        "tag",
        "two-docs",
        "quote",
        "list",
        "complex-key",
    ],
)
def test_hostile_yaml_is_refused_quickly_with_a_position(tmp_path, body, code):
    path = tmp_path / "h.yaml"
    path.write_text(body)
    start = time.perf_counter()
    problem = only(path)
    assert time.perf_counter() - start < 5  # the alias bomb took 59 s and 4.7 GB before
    assert problem.code == code
    assert problem.file.endswith("h.yaml")
    assert len(problem.render()) < 20_000  # not 40 MB of expanded aliases


def test_unbalanced_quote_in_rlflow_command():
    problem = only(TINY, ["slurm.rlflow_command=uv run 'rlflow"])
    assert problem.code == "recipe.rlflow-command"
    assert "No closing quotation" in problem.message


def test_python_version_310_is_not_read_as_31(tmp_path):
    problem = only(recipe(tmp_path, "generation:\n  vllm:\n    cpu:\n      python: 3.10\n"))
    assert problem.code == "recipe.ambiguous" and "did you mean '3.10'?" in problem.help


@pytest.mark.parametrize(
    "override, message",
    [
        ("grpo.max_num_steps=010", "which YAML reads as the number 10 (YAML 1.2) or 8"),
        ("grpo.max_num_steps=1_000", "is 1_000, but must be an integer"),
        ("grpo.val_at_start=yes", "YAML 1.2 reads yes as text"),
        ("grpo.max_num_steps='5'", "is '5', but must be an integer"),
    ],
)
def test_numbers_and_booleans_follow_yaml_12(override, message):
    problem = only(TINY, [override])
    assert message in problem.message + " " + (problem.help or "")


HOSTILE = [
    "12:00:00",
    "010",
    "1.10",
    "0o17",
    "1e3",
    "yes",
    "null",
    "",
    "#gpu",
    "a: b",
    "*x",
    "x\ny",
    "'",
    '"',
    "\t",
    "3.10",
    "-.inf",
    "~",
    "true",
    "0x1F",
    "+5",
    "é\u2028",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_dumped_recipe_reads_back_as_itself(tmp_path, text):
    loaded = load_recipe(TINY)
    data = loaded.data
    data["run"]["name"] = text
    data["slurm"]["env"] = {"X": text}
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_recipe(data))
    again = load_recipe(path)
    assert again.recipe.run.name == text and again.recipe.slurm.env == {"X": text}
    assert again.data == data


# Strings that stress the emitters: quoting, folding at the width (100), key lengths around the
# 128 characters of a simple key, and (for the fallback) non-ASCII and control characters.
_PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300)
_WORDS = st.sampled_from(["yes", "null", "~", "1e3", "0x1F", "12:00:00", "#x", "a: b", "- x", "'"])
_ANY = st.text(st.characters(blacklist_categories=("Cs",)), max_size=150)
_TEXT = _PRINTABLE | _WORDS | st.lists(_WORDS, max_size=40).map(" ".join) | _ANY
_SCALAR = _TEXT | st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
_TREE = st.recursive(
    _SCALAR,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            _PRINTABLE | _ANY | st.text("ab'", min_size=95, max_size=140), inner, max_size=4
        )
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(_TREE)
def test_libyaml_writes_the_resolved_recipe_as_pyyaml_does(tree):
    """dump_recipe uses libyaml's emitter only where it writes PyYAML's text to the byte."""
    data = {"run": {"name": tree, "list": [copy.deepcopy(tree)]}}  # (no YAML aliases)
    assert dump_recipe(data) == load_module._dump(data, load_module._Dumper)


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_dumps_alike_with_libyaml(recipe):
    data = load_recipe(recipe).data
    assert load_module._emits_alike(data)  # libyaml writes these
    assert dump_recipe(data) == load_module._dump(data, load_module._Dumper)
