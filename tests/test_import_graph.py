"""rlflow's import graph: no cycle, not even through lazy imports, and one layer order.

Read from the source with `ast` (nothing is imported): an edge A -> B for every `import` statement
in A (module body only, or anywhere including inside functions). Imports inside functions are
deliberate lazy imports (heavy libraries, the backend the recipe names, or a login-node command
that must not pull in the trainer); they make no cycle at import time, but a cycle through them
still means two modules each need the other, so the whole package is held to the same rule: e.g.
a backend factory cannot sit in the interface module its backends import, and a pipeline two
commands share lives in its own module, not in one of them.

The layers, bottom first (LAYERS below); a module imports only its own layer and those below:

    errors, bounded         exit codes, diagnostics; bounded reads of files others wrote
    recipe, job.files, slurm, optional, compat
                            leaves: the recipe's types and its loader, the run directory's names,
                            every Slurm call, optional packages, third-party patches
    pins, cicheck           check-pins, check-tests
    data                    datasets, prompts, rewards
    parallel                process groups
    model                   policies, one module (or folder) per family under model/families/
                            (never generation, never train)
    rules                   the recipe's rules; they ask data/ and model/family.py, so they sit
                            above both (while the types everything reads sit at the bottom)
    envs, generation        the vLLM environment, rollout backends (generation/megatron/,
                            generation/vllm/)
    serve                   the OpenAI-compatible server on the engine (`rlflow serve`)
    environment             how a rollout is made: single-turn, or multi-turn with tool calls
                            (its tools are read with serve/tools.py)
    job                     what runs in the job: node launcher, attempt decision, preflight, and
                            the same launcher on this machine (`rlflow train --nproc`: job/local.py)
    train                   a rank's trainer, and the generation ranks' program
                            (train/generation_role/)
    launch                  the login-node commands: they read job/files.py, never job's runtime
    cli                     the console script

So model, recipe and rules never import train, the job never imports launch, and train never imports
launch. Apart from the order: the login-node modules never import torch (nor megatron,
transformers or vLLM), and the family registry is login-node safe.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlflow"


def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(path: Path, name: str, modules: dict[str, Path], top_level_only: bool) -> set[str]:
    """The rlflow modules `path` imports.

    `from pkg import mod` counts as pkg.mod only, like `import pkg.mod`: Python finds a submodule
    even while pkg/__init__.py is still running, so it needs nothing that __init__ defines.
    `from pkg import name` (a name __init__ defines) counts as pkg.
    """
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]  # a name: trimmed to base
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports(path, name, modules, top_level_only) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_rlflow_has_no_import_cycle_at_module_level():
    assert cycles(graph(top_level_only=True)) == []


def test_rlflow_has_no_import_cycle_even_through_lazy_imports():
    assert cycles(graph(top_level_only=False)) == []


def test_the_family_registry_is_login_node_safe():
    """Listing the model families imports no torch, transformers or megatron (the dry run may)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from rlflow.model import family\n"
        "print(family.builtin_names())\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'megatron')]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "tiny-qwen2vl" in result.stdout


# --- the layer order -----------------------------------------------------------------------------
# Bottom first. A module may import its own layer and the layers below it, never one above, not
# even lazily. A layer names module prefixes: a package, or one of its parts that sits lower than
# the rest of it (the recipe's types below everything that reads them, the library patches below
# parallel.py).
LAYERS = [
    # the ground: exit codes and diagnostics; `@frozen`, the cheaper frozen dataclass; bounded
    # reads of files others put in place
    ("rlflow.errors", "rlflow.frozen", "rlflow.record_methods", "rlflow.bounded"),
    # leaves: the recipe's types (with their bounds and scalar parsers) and its loader, the run
    # directory's file names, every Slurm call, optional packages, third-party patches
    (
        "rlflow.recipe",
        "rlflow.job.files",
        "rlflow.slurm",
        "rlflow.optional",
        "rlflow.compat",
    ),
    ("rlflow.pins", "rlflow.cicheck"),  # check-pins, check-tests
    ("rlflow.data",),  # datasets, prompts, rewards
    ("rlflow.parallel",),  # process groups
    ("rlflow.model",),  # megatron-core policies, one module or folder per family (model/families/)
    ("rlflow.rules",),  # the recipe's rules, which ask data/ and model/family.py
    ("rlflow.envs",),  # the vLLM environment
    ("rlflow.generation",),  # rollout backends: generation/megatron/, generation/vllm/
    ("rlflow.serve",),  # the OpenAI-compatible server on the engine (`rlflow serve`)
    ("rlflow.environment",),  # how a rollout is made: one turn, or tool calls (multi-turn)
    ("rlflow.job",),  # in the job: the node launcher (also `rlflow train --nproc`), preflight
    ("rlflow.train",),  # a rank's trainer, and the generation ranks' (train/generation_role/)
    ("rlflow.launch",),  # the login-node commands
    ("rlflow.cli", "rlflow"),  # the console script
]
# Modules the login node imports: `--help`, submit --dry-run, status, check-pins. No torch.
LOGIN_NODE = ("rlflow.cli", "rlflow.launch", "rlflow.pins", "rlflow.cicheck", "rlflow.recipe")
LOGIN_NODE += ("rlflow.rules",)
LOGIN_NODE += ("rlflow.job", "rlflow.slurm", "rlflow.errors", "rlflow.frozen", "rlflow.optional")
LOGIN_NODE += ("rlflow.record_methods", "rlflow.bounded")
LOGIN_NODE += ("rlflow.model.family",)
LOGIN_NODE += ("rlflow.serve.command",)  # `rlflow --help` lists it
HEAVY = ("torch", "megatron", "transformers", "vllm")


def layer(module: str) -> int:
    """The layer of `module`: the one with the longest prefix that matches it."""
    best = max(
        (len(prefix), i)
        for i, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    )
    return best[1]


def test_the_layers_name_every_module():
    assert [
        m
        for m in module_names()
        if not any(m == p or m.startswith(p + ".") for ps in LAYERS for p in ps)
    ] == []


def test_no_module_imports_a_layer_above_its_own():
    """So, among others: model and recipe never import train; data never imports model; the
    in-job code never imports the login-node commands (job/ under launch/), and train never
    imports launch."""
    edges = graph(top_level_only=False)
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in edges.items()
        for target in targets
        if layer(target) > layer(name)
    )
    assert upward == []


def test_the_login_node_commands_import_only_the_contract_of_the_job():
    """launch/ reads what the job writes (job/files.py) and never imports the job's runtime
    (the launcher, the attempt decision, preflight): those run on other machines."""
    edges = graph(top_level_only=False)
    runtime = sorted(
        f"{name} -> {target}"
        for name, targets in edges.items()
        if name.startswith("rlflow.launch")
        for target in targets
        if target.startswith("rlflow.job") and target != "rlflow.job.files"
    )
    assert runtime == []


def test_login_node_modules_never_import_torch():
    """Every login-node module imported at once (module level: what `--help`, the dry run,
    `status` and `check-pins` load) pulls in no torch, megatron, transformers or vLLM."""
    import subprocess
    import sys

    names = sorted(
        m for m in module_names() if m.startswith(LOGIN_NODE) and not m.endswith("__main__")
    )
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "print(heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"login-node modules import {result.stdout.strip()}"
