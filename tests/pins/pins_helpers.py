"""Helpers for the check-pins tests: real git repositories with real nested submodules.

Layout (the shape of a training repo that vendors Megatron-Bridge, which nests Megatron-LM):

    trainer/                                     root pyproject.toml
      submodules/Megatron-Bridge/                submodule, pyproject.toml
        3rdparty/Megatron-LM/                    nested submodule, pyproject.toml

git runs with no user/system config and `protocol.file.allow=always`, so submodules can be
cloned from local paths on any machine, offline.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rlflow.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]
EMO_URL = "https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git"
BRIDGE_PATH = "submodules/Megatron-Bridge"
LM_PATH = "submodules/Megatron-Bridge/3rdparty/Megatron-LM"

GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "rlflow tests",
    "GIT_AUTHOR_EMAIL": "tests@rlflow.invalid",
    "GIT_COMMITTER_NAME": "rlflow tests",
    "GIT_COMMITTER_EMAIL": "tests@rlflow.invalid",
}


def root_toml(emo: str = "v0.3.0", body: str = "") -> str:
    """The training repo's pyproject; `emo` is its emerging-optimizers git rev."""
    return f"""\
[project]
name = "trainer"
version = "0.1.0"
requires-python = ">=3.12"
dependencies = ["torch==2.11.0"]

[project.optional-dependencies]
mcore = ["megatron-bridge"]

[tool.uv]
# Keep in sync with Megatron-LM's [tool.uv.sources] (uv errors loudly on mismatch).
constraint-dependencies = [
    "emerging-optimizers @ git+{EMO_URL}@{emo}",  # bumped with the submodule
]

[tool.uv.sources]
megatron-bridge = {{ path = "{BRIDGE_PATH}", editable = true }}
{body}"""


def bridge_toml(body: str = "", deps: str = '"megatron-core[dev]", "transformers>=5.0"') -> str:
    return f"""\
[project]
name = "megatron-bridge"
version = "0.6.2"
requires-python = ">=3.10"
dependencies = [{deps}]

[tool.uv.sources]
megatron-core = {{ path = "3rdparty/Megatron-LM" }}
{body}"""


def lm_toml(emo: str = "v0.3.0", body: str = "") -> str:
    """Megatron-LM's pyproject: pins emerging_optimizers (underscore: PEP 503 must match)."""
    return f"""\
[project]
name = "megatron-core"
dynamic = ["version"]
requires-python = ">=3.10"
dependencies = ["torch", "numpy"]

[project.optional-dependencies]
dev = ["emerging_optimizers", "einops"]

[tool.uv.sources]
emerging_optimizers = {{ git = "{EMO_URL}", rev = "{emo}" }}
{body}"""


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "protocol.file.allow=always", *args],
        cwd=cwd,
        env={**os.environ, **GIT_ENV},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"git {args} failed in {cwd}: {done.stderr}"
    return done.stdout


def make_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text, encoding="utf-8")
    commit_all(path, "initial")
    return path


def commit_all(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", message)


def add_submodule(parent: Path, upstream: Path, rel: str) -> None:
    git(parent, "submodule", "add", "-q", str(upstream), rel)
    git(parent, "submodule", "update", "-q", "--init", "--recursive")
    git(parent, "commit", "-q", "-m", f"add {rel}")


@dataclass(frozen=True)
class Layout:
    root: Path
    upstream_bridge: Path
    upstream_lm: Path

    @property
    def bridge(self) -> Path:
        return self.root / BRIDGE_PATH

    @property
    def lm(self) -> Path:
        return self.root / LM_PATH


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str

    @property
    def json(self) -> dict:
        return json.loads(self.out)

    def codes(self) -> list[str]:
        return [d["code"] for d in self.json["diagnostics"]]


def check_pins(*args: str) -> Result:
    """Run `rlflow check-pins ARGS` in-process through the real entry point."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["check-pins", *map(str, args)])
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return Result(code, out.getvalue(), err.getvalue())


def line_of(path: Path, needle: str) -> int:
    """1-based line number of the first line containing `needle` (to check reported lines)."""
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if needle in text:
            return number
    raise AssertionError(f"{needle!r} not in {path}")
