"""The launch tests' fixtures: a git repository with pin drift. (The Slurm cluster is the
session's one, from tests/slurm/cluster.py through tests/conftest.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# --- a uv project with pin drift: the root and its submodule pin different git tags ------------

DRIFT_DEP = """\
[project]
name = "dep"
version = "0.1.0"
dependencies = ["emerging-optimizers"]

[tool.uv.sources]
emerging-optimizers = { git = "https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git", rev = "v0.3.0" }
"""

DRIFT_ROOT = """\
[project]
name = "project"
version = "0.1.0"
dependencies = ["dep"]

[tool.uv]
constraint-dependencies = [
    "emerging-optimizers @ git+https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git@v0.2.0",
]

[tool.uv.sources]
dep = { path = "submodules/dep", editable = true }
"""


def git(cwd: Path, *args: str) -> str:
    """git with a fixed identity and no user config; local paths allowed as submodule URLs."""
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    return subprocess.run(
        ["git", "-c", "protocol.file.allow=always", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    for name, text in files.items():
        (path / name).write_text(text)
    git(path, "add", *files)
    git(path, "commit", "-q", "-m", "initial")
    return path


@pytest.fixture
def drift_repo(tmp_path) -> Path:
    """A real git repository whose submodule pins emerging-optimizers v0.3.0 while the root
    constrains v0.2.0 (the incident check-pins exists for)."""
    dep = make_repo(tmp_path / "upstream" / "dep", {"pyproject.toml": DRIFT_DEP})
    root = make_repo(tmp_path / "project", {"pyproject.toml": DRIFT_ROOT})
    git(root, "submodule", "add", "-q", str(dep), "submodules/dep")
    git(root, "commit", "-q", "-m", "add submodules/dep")
    return root
