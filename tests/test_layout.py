"""The test tree mirrors the package: tests/<pkg>/test_<pkg>_<topic>.py tests rlflow/<pkg>/.

One naming rule, so a newcomer finds a module's tests by its package name, and `pytest
tests/<pkg>` runs exactly that package's tests. Top-level tests (tests/test_*.py) cover the
whole package (the CLI's examples, the import graph, this layout).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_file_is_named_after_the_package_folder_it_mirrors():
    packages = {p.name for p in (ROOT / "rlflow").iterdir() if (p / "__init__.py").is_file()}
    misnamed = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        relative = path.relative_to(ROOT / "tests")
        if len(relative.parts) == 1:
            continue  # whole-package tests
        folder = relative.parts[0]
        if folder not in packages or not path.name.startswith(f"test_{folder}_"):
            misnamed.append(str(relative))
    assert not misnamed, (
        f"test files must be tests/<pkg>/test_<pkg>_<topic>.py for a package in rlflow/: {misnamed}"
    )


MAX_MODULE_LINES = 500
MAX_CLASS_METHODS = 12


def test_no_module_is_over_500_lines_and_no_class_over_12_methods():
    """Size limits that keep a module readable in one sitting (issue 21): a module that grows
    past them is split by what it does, not by line count (docs/where-does-my-change-go.md)."""
    import ast

    too_long, too_wide = [], []
    for path in sorted((ROOT / "rlflow").rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        if (lines := text.count("\n")) > MAX_MODULE_LINES:
            too_long.append(f"{name} ({lines} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [
                    n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                if len(methods) > MAX_CLASS_METHODS:
                    too_wide.append(f"{name}: {node.name} ({len(methods)} methods)")
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"
    assert not too_wide, f"classes over {MAX_CLASS_METHODS} methods: {too_wide}"
