"""Login-node speed: `rlflow --help` and `rlflow check-pins` never import torch, megatron or
transformers (each would add seconds). Checked in a fresh interpreter per command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pins_helpers import REPO_ROOT, make_repo, root_toml

HEAVY = {"torch", "megatron", "transformers"}
PROBE = """
import json, sys
from rlflow.cli import main
try:
    main(json.loads(sys.argv[1]))
except SystemExit:
    pass
loaded = sorted({m.split(".")[0] for m in sys.modules})
print("MODULES=" + json.dumps(loaded), file=sys.stderr)
"""


def loaded_modules(*argv: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(list(argv))],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    line = next(x for x in done.stderr.splitlines() if x.startswith("MODULES="))
    return set(json.loads(line.removeprefix("MODULES=")))


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["check-pins", "--help"],
        ["check-pins", "--repo", str(REPO_ROOT)],
        ["check-pins", "--example", "--fix"],
        ["check-tests", "--repo", str(REPO_ROOT)],
        ["bump", "--help"],
    ],
)
def test_commands_leave_heavy_modules_unimported(argv):
    loaded = loaded_modules(*argv)
    assert "rlflow" in loaded
    assert not loaded & HEAVY, f"{argv} imported {sorted(loaded & HEAVY)}"


def test_nested_submodules_check_stays_light(nested):
    layout = nested(root=root_toml(emo="v0.2.0"))
    loaded = loaded_modules("check-pins", "--repo", str(layout.root))
    assert "rlflow" in loaded
    assert "git" not in loaded  # the walk runs the git executable, not gitpython...
    assert not loaded & HEAVY  # ...and nothing heavy came with it


def test_repository_without_submodules_does_not_load_tomlkit(tmp_path):
    repo = make_repo(tmp_path / "plain", {"pyproject.toml": root_toml()})
    loaded = loaded_modules("check-pins", "--repo", str(repo))
    assert "git" not in loaded and "tomlkit" not in loaded
