"""What a fresh clone's set-up files promise: the Python versions they name are ones the project
can use, the README says how to get that Python where uv cannot download one, and CI leaves a
record of where the suite's time went."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def requires_python() -> SpecifierSet:
    return SpecifierSet(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    )


def test_python_version_lists_only_versions_the_project_can_use():
    """uv reads .python-version to choose the interpreter: a version requires-python excludes
    (3.11 against >=3.12) is one uv may find or fetch and the project then refuses."""
    listed = [
        line.strip()
        for line in (ROOT / ".python-version").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert listed, ".python-version names no version"
    allowed = requires_python()
    unusable = [v for v in listed if Version(v) not in allowed]
    assert not unusable, f".python-version lists {unusable}, outside requires-python {allowed}"


def test_readme_says_which_python_and_how_to_use_one_uv_did_not_download():
    quick_start = (ROOT / "README.md").read_text().split("## Quick start", 1)[1][:1500]
    assert f'requires-python = "{requires_python()}"' in quick_start
    assert "uv run --python /path/to/python3.12" in quick_start


def test_ci_prints_the_25_slowest_tests():
    """The suite's run leaves a record of where its time went (`pytest --durations=25`)."""
    runs = [
        shlex.split(line)
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("uv run pytest")
    ]
    assert runs and all("--durations=25" in run for run in runs), runs
