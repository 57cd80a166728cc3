"""Check a `package.module:function` reward path without running the user's code.

The login node must not import torch (or whatever the user's reward module imports), so the
dry run finds the module's file the way `import` would (the working directory, then
sys.path, then installed finders) without executing any package's `__init__`, and reads its
source with `ast` for a top-level binding of the function. A module it cannot read as source
(a C extension, a module with `from x import *` or a module-level `__getattr__`) passes: the
trainer imports it for real at start-up and fails there with the import error.
"""

from __future__ import annotations

import ast
import difflib
import importlib.machinery
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
IMPORT_PATH_RE = re.compile(rf"^{_NAME}(\.{_NAME})*:{_NAME}$")


def search_path() -> list[str]:
    """Where user reward modules are found: the working directory first (as `python -m`)."""
    return [os.getcwd()]


def check_import_path(spec: str, path: Sequence[str] | None = None) -> tuple[str, str] | None:
    """None when `spec` looks importable, else (problem, help)."""
    if not IMPORT_PATH_RE.match(spec):
        return (
            f"`{spec}` is not an import path",
            "write package.module:function, e.g. my_rewards:brevity (module my_rewards.py)",
        )
    module, _, attr = spec.partition(":")
    where = list(path if path is not None else search_path())
    origin = find_module_source(module, where)
    if origin is None:
        top = module.split(".")[0]
        return (
            f"no module `{module}` is importable from {where[0] if where else 'sys.path'}",
            f"run rlflow from the directory that holds {top}.py (or the {top}/ package), "
            "or add that directory to PYTHONPATH",
        )
    if origin.suffix != ".py":
        return None  # compiled or namespace: only a real import can tell
    try:
        tree = ast.parse(origin.read_bytes(), filename=str(origin))
    except SyntaxError as exc:
        return (
            f"module `{module}` ({origin}:{exc.lineno}) has a syntax error: {exc.msg}",
            "fix the module; the trainer would fail importing it",
        )
    names, opaque = top_level_names(tree)
    if attr in names:
        return _check_signature(names[attr], spec)
    if opaque:
        return None
    close = difflib.get_close_matches(attr, [n for n in names if not n.startswith("_")], n=1)
    return (
        f"module `{module}` ({origin}) has no function `{attr}`",
        (f"did you mean `{module}:{close[0]}`? " if close else "")
        + "a reward is a top-level function of one RewardBatch",
    )


def find_module_source(module: str, path: Sequence[str]) -> Path | None:
    """The file (or namespace directory) `import module` would load, found without executing
    anything: parents' `__init__` files are located, never run."""
    parts = module.split(".")
    spec = importlib.machinery.PathFinder.find_spec(parts[0], list(path) + sys.path)
    if spec is None:
        for finder in sys.meta_path:  # editable installs and other installed finders
            if finder is importlib.machinery.PathFinder:
                continue
            try:
                spec = finder.find_spec(parts[0], None)
            except Exception:  # a third-party finder's own problem is not ours to report
                spec = None
            if spec is not None:
                break
    for depth in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return None
        name = ".".join(parts[: depth + 1])
        spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin)
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]) if locations else Path(module)


def top_level_names(tree: ast.Module) -> tuple[dict[str, ast.AST], bool]:
    """Names a module binds at top level (also inside if/try/with), and whether it may bind
    names no parser can see (`from x import *`, a module-level `__getattr__`)."""
    names: dict[str, ast.AST] = {}
    opaque = False

    def visit(body: list[ast.stmt]) -> None:
        nonlocal opaque
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names[node.name] = node
                opaque |= node.name == "__getattr__"
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names[leaf.id] = node
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        opaque = True
                    else:
                        names[alias.asname or alias.name.split(".")[0]] = node
            elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
                for child in ("body", "orelse", "finalbody"):
                    visit(getattr(node, child, []) or [])
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return names, opaque


def _check_signature(node: ast.AST, spec: str) -> tuple[str, str] | None:
    if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Lambda):
        args, name = node.value.args, "a lambda"  # `reward = lambda batch: ...`
    elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        args, name = node.args, node.name
    else:
        return None  # a callable object, an alias, a class: only a real call can tell
    positional = args.posonlyargs + args.args
    required = len(positional) - len(args.defaults)
    kw_required = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    if (not positional and args.vararg is None) or required > 1 or kw_required:
        fix = spec.partition(":")[2]
        return (
            f"`{spec}` takes ({ast.unparse(args)}), but a reward is called with one argument",
            f"define it as `def {fix}(batch: RewardBatch) -> list[float]` "
            "(rlflow.data.rewards.RewardBatch)" + (f"; it is {name} now" if name != fix else ""),
        )
    return None
