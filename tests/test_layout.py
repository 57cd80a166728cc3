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
