"""rlflow's import graph: no cycle, not even through lazy imports; the model layer never imports
generation.

Read from the source with `ast` (nothing is imported): an edge A -> B for every `import` statement
in A (module body only, or anywhere including inside functions). Imports inside functions are
deliberate lazy imports (heavy libraries, the backend the recipe names, or a login-node command
that must not pull in the trainer); they make no cycle at import time, but a cycle through them
still means two modules each need the other, so the whole package is held to the same rule: e.g.
a backend factory cannot sit in the interface module its backends import, and a pipeline two
commands share lives in its own module, not in one of them.
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


def test_the_model_layer_never_imports_generation():
    edges = graph(top_level_only=False)
    offenders = {
        name: sorted(t for t in targets if t.startswith("rlflow.generation"))
        for name, targets in edges.items()
        if name.startswith("rlflow.model")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


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
