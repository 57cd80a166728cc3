"""The bundled example repository: the emerging-optimizers incident, rebuilt with real git.

A training repo (`trainer/`) has Megatron-Bridge as a submodule, which nests Megatron-LM as
its own submodule. Megatron-LM's pyproject moved `emerging-optimizers` from git tag v0.2.0 to
v0.3.0; the root still constrains v0.2.0, so `uv lock` would fail with "Requirements contain
conflicting URLs for package `emerging-optimizers`". Everything is local: three `git init`s,
two `git submodule add`s of local paths, no network (about 0.2 s).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError

MEGATRON_LM = """\
[project]
name = "megatron-core"
dynamic = ["version"]
requires-python = ">=3.10"
dependencies = ["torch", "numpy", "packaging"]

[project.optional-dependencies]
dev = ["emerging_optimizers", "einops"]

[dependency-groups]
# Megatron-LM's own CI tooling: never installed for a dependency, so never a conflict.
test = ["nemo-run", "pytest"]

[tool.uv.sources]
emerging_optimizers = { git = "https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git", rev = "v0.3.0" }
nemo-run = { git = "https://github.com/NVIDIA-NeMo/Run.git", rev = "e3935393" }
"""

MEGATRON_BRIDGE = """\
[project]
name = "megatron-bridge"
version = "0.6.2"
requires-python = ">=3.10"
dependencies = ["megatron-core[dev]", "transformers>=5.0"]

[tool.uv.sources]
megatron-core = { path = "3rdparty/Megatron-LM", editable = true }
"""

TRAINER = """\
[project]
name = "trainer"
version = "0.1.0"
requires-python = ">=3.12"
dependencies = ["torch==2.11.0"]

[project.optional-dependencies]
mcore = ["megatron-bridge"]

[tool.uv]
# emerging-optimizers flows transitively from megatron-core[dev], whose [tool.uv.sources] pins
# it to git. uv requires such URL dependencies at the root too: keep in sync with Megatron-LM.
constraint-dependencies = [
    "emerging-optimizers @ git+https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git@v0.2.0",
]

[tool.uv.sources]
megatron-bridge = { path = "submodules/Megatron-Bridge", editable = true }
"""


def build_example(dest: Path) -> Path:
    """Create the three repositories under `dest`; return the training repository's path."""
    megatron_lm = make_repo(dest / "upstream" / "Megatron-LM", {"pyproject.toml": MEGATRON_LM})
    bridge = make_repo(dest / "upstream" / "Megatron-Bridge", {"pyproject.toml": MEGATRON_BRIDGE})
    add_submodule(bridge, megatron_lm, "3rdparty/Megatron-LM")
    trainer = make_repo(dest / "trainer", {"pyproject.toml": TRAINER})
    add_submodule(trainer, bridge, "submodules/Megatron-Bridge")
    return trainer


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text, encoding="utf-8")
    git(path, "add", *files)
    git(path, "commit", "-q", "-m", "initial")
    return path


def add_submodule(parent: Path, child: Path, rel: str) -> None:
    """`git submodule add` of a local path, its own submodules checked out too, committed."""
    git(parent, "submodule", "add", "-q", str(child), rel)
    git(parent, "submodule", "update", "-q", "--init", "--recursive")
    git(parent, "commit", "-q", "-m", f"add {rel}")


def git(cwd: Path, *args: str) -> str:
    """Run git with a fixed identity and no user/system config, so it behaves the same anywhere;
    `protocol.file.allow=always` lets submodules be cloned from local paths."""
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "rlflow example",
        "GIT_AUTHOR_EMAIL": "example@rlflow.invalid",
        "GIT_COMMITTER_NAME": "rlflow example",
        "GIT_COMMITTER_EMAIL": "example@rlflow.invalid",
    }
    try:
        done = subprocess.run(
            ["git", "-c", "protocol.file.allow=always", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        done = None
    if done is None or done.returncode != 0:
        reason = done.stderr.strip() if done else "git is not installed"
        raise RlflowError(
            Diagnostic(
                "RF106", f"building the example: `git {' '.join(args)}` failed in {cwd}: {reason}"
            )
        )
    return done.stdout
