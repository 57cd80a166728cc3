"""No hidden defaults: a keyword default in rlflow/ that shadows a recipe key is an error.

Defaults live in recipes/base.yaml only; code that acts on a recipe key takes its value from
the caller, who passes the recipe's (`init_parallel(..., timeout_s=recipe.watchdog.
collective_timeout_s)`). A default there would be a second default that silently wins whenever
a caller forgets the key (`compile_decode=False` against base.yaml's `true`, found last round).

The lint reads rlflow/ with `ast` (nothing is imported): every function parameter and every
class-level field with a default whose name is a recipe key's name (its last part, or an alias
below) is flagged, unless `NOT_A_RECIPE_KEY` says why that name means something else there.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

from rlflow.recipe import schema

ROOT = Path(__file__).resolve().parents[2]

# Parameter names that carry a recipe key under another name.
ALIASES = {
    "startup_timeout": "watchdog.startup_timeout_s",
    "collective_timeout_s": "watchdog.collective_timeout_s",
    "tiny_seed": "model.tiny_seed",
    "max_tokens": "optimizer.max_tokens_per_micro_batch",
    "packed": "optimizer.sequence_packing",
    "template": "data.prompt_template",
}

# (file, function or class, name) -> why the name is not the recipe key of that name there.
NOT_A_RECIPE_KEY = {
    **{
        ("rlflow/serve/chat.py", "ChatRequest", name): "a chat request's field: the OpenAI API's "
        "default when a client sends none"
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed")
    },
    ("rlflow/data/reward_pool.py", "Outcome", "kind"): "the kind of a reward failure",
    ("rlflow/data/sample.py", "Sample", "kind"): "a row's kind, set by the dataset that made it",
    (
        "rlflow/data/sample.py",
        "Sample",
        "template",
    ): "a row's question family (per-family accuracy)",
    ("rlflow/data/scene.py", "Scene", "num_frames"): "a still image is a scene of one frame",
    ("rlflow/data/scene.py", "place", "num_frames"): "a still image is a scene of one frame",
    ("rlflow/data/user_rewards.py", "check_import_path", "path"): "a module search path",
    ("rlflow/compat/te_guard.py", "find_spec", "path"): "importlib's finder protocol",
    ("rlflow/compat/cpu_compat.py", "factory", "device"): "a torch device",
    ("rlflow/model/tiny.py", "write_tiny_checkpoint", "device"): "the torch device to build on",
    (
        "rlflow/model/families/qwen3vl/__init__.py",
        "write_tiny_qwen3vl",
        "device",
    ): "the torch device to build on",
    (
        "rlflow/model/families/nemotron_h/__init__.py",
        "write_tiny_nemotron_h",
        "device",
    ): "the torch device to build on",
    (
        "rlflow/model/families/nemotron_omni/__init__.py",
        "write_tiny_nemotron_omni",
        "device",
    ): "the torch device to build on",
    ("rlflow/pins/bump.py", "_resolve", "path"): "a submodule's path, not a dataset's",
    ("rlflow/cicheck/shell.py", "invocations", "env"): "a CI line's environment",
    ("rlflow/cicheck/scripts.py", "shards_of", "env"): "a CI script's environment",
    ("rlflow/cicheck/scripts.py", "script_shards", "env"): "a CI script's environment",
    (
        "rlflow/model/families/qwen2vl.py",
        "write_tiny_qwen2vl",
        "device",
    ): "the torch device to build on",
    ("rlflow/model/media.py", "concat", "device"): "the torch device to join the media on",
    ("rlflow/envs/spec.py", "vllm_spec", "device"): "None: generation.vllm.device decides",
    ("rlflow/parallel.py", "all_reduce_sum", "group"): "a process group",
    ("rlflow/parallel.py", "all_reduce_max", "group"): "a process group",
    ("rlflow/train/collect.py", "Scored", "rewards"): "a step's accumulated rewards",
    ("rlflow/train/collect.py", "Scored", "accuracy"): "a step's accumulated accuracy",
    ("rlflow/launch/plan.py", "JobPlan", "placement"): "the dry run's line; None: colocated",
    ("rlflow/train/watchdog.py", "_State", "path"): "the heartbeat file (module state)",
    ("rlflow/train/watchdog.py", "_State", "enabled"): "module state, set from the recipe",
    (
        "rlflow/train/update.py",
        "from_config",
        "lr",
    ): "None: optimizer.lr (warm start passes its own)",
    ("rlflow/cicheck/collect.py", "collect", "env"): "a CI job's environment",
    ("rlflow/cicheck/shard.py", "Shard", "env"): "a CI shard's environment",
    ("rlflow/pins/lock/lowering.py", "lower", "group"): "a dependency group",
    ("rlflow/pins/markers.py", "satisfiable", "python"): "a Python version marker",
    ("rlflow/pins/markers.py", "equivalent_sets", "python"): "a Python version marker",
    ("rlflow/pins/markers.py", "same", "python"): "a Python version marker",
    ("rlflow/pins/lock/uvlock.py", "UvLock", "packages"): "the packages of a uv.lock",
    ("rlflow/model/moe/experts.py", "__init__", "name"): "megatron-core's SequentialMLP signature",
    (
        "rlflow/model/families/qwen3_moe.py",
        "write_tiny_qwen3_moe",
        "device",
    ): "the torch device to build on",
    ("rlflow/model/moe/routing.py", "step_metrics", "group"): "a process group",
}


def recipe_key_names() -> dict[str, str]:
    names: dict[str, str] = {}

    def walk(cls, path):
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[field.name]):
                walk(hints[field.name], (*path, field.name))
            else:
                names.setdefault(field.name, ".".join((*path, field.name)))

    walk(schema.Recipe, ())
    return {**names, **ALIASES}


def defaults_in(path: Path):
    """(owner, name, default source, line) for every defaulted parameter and class field."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                yield node.name, arg.arg, ast.unparse(default), node.lineno
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and item.value is not None:
                    if isinstance(item.target, ast.Name):
                        yield node.name, item.target.id, ast.unparse(item.value), item.lineno


def shadowing_defaults() -> list[str]:
    names = recipe_key_names()
    found = []
    for path in sorted((ROOT / "rlflow").rglob("*.py")):
        module = str(path.relative_to(ROOT))
        if module.startswith("rlflow/recipe/"):
            continue  # the recipe package defines the keys (its dataclasses have no defaults)
        for owner, name, default, line in defaults_in(path):
            if name in names and (module, owner, name) not in NOT_A_RECIPE_KEY:
                found.append(f"{module}:{line} {owner}({name}={default}) shadows {names[name]}")
    return found


def test_no_keyword_default_shadows_a_recipe_key():
    assert shadowing_defaults() == [], (
        "drop these defaults and pass the recipe's value from the caller (or, where the name "
        "means something else, say why in NOT_A_RECIPE_KEY)"
    )


def test_every_exemption_is_still_in_the_code():
    """An exemption whose default is gone is removed too, so the list stays short and true."""
    present = set()
    for path in sorted((ROOT / "rlflow").rglob("*.py")):
        module = str(path.relative_to(ROOT))
        present |= {(module, owner, name) for owner, name, _, _ in defaults_in(path)}
    assert set(NOT_A_RECIPE_KEY) - present == set()
