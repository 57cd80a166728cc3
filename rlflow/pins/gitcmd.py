"""Run git with a clean environment: the one place check-pins, bump and the refs policy call git.

git exports `GIT_INDEX_FILE`, `GIT_DIR`, `GIT_PREFIX`... to hooks. Inherited by a git call made
inside a submodule, they point it at the parent's index ("index file open failed: Not a
directory") or at the wrong repository. Like git's own submodule code, every call here drops
the repository-local variables (`git rev-parse --local-env-vars`) and keeps the `-c` config
that the user passed. The one exception is deliberate: the repository the hook runs for reads
the index git is about to commit (`commit -a`, `commit <paths>` use a temporary index).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError

# `git rev-parse --local-env-vars` (git 2.39), minus the config variables git keeps for submodules.
LOCAL_ENV_VARS = (
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_DIR",
    "GIT_GRAFT_FILE",
    "GIT_IMPLICIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_INTERNAL_SUPER_PREFIX",
    "GIT_NO_REPLACE_OBJECTS",
    "GIT_OBJECT_DIRECTORY",
    "GIT_PREFIX",
    "GIT_REPLACE_REF_BASE",
    "GIT_SHALLOW_FILE",
    "GIT_WORK_TREE",
)


# A work tree whose repository lives elsewhere (`GIT_DIR=... GIT_WORK_TREE=... git commit`, no
# `.git` in the work tree): work tree -> git dir, so calls there keep pointing at it.
SEPARATE_GIT_DIRS: dict[str, str] = {}
# Processes begun by `start`; `reap` waits for any left unread.
STARTED: list[subprocess.Popen] = []


def clean_env(index_file: str | None = None, cwd: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_ENV_VARS}
    if cwd is not None and SEPARATE_GIT_DIRS:
        top = str(Path(cwd).resolve())
        if top in SEPARATE_GIT_DIRS:
            env["GIT_DIR"], env["GIT_WORK_TREE"] = SEPARATE_GIT_DIRS[top], top
    env["GIT_OPTIONAL_LOCKS"] = "0"  # read-only calls never take index.lock from a running commit
    if index_file:
        env["GIT_INDEX_FILE"] = index_file
    return env


def hook_index_file() -> str | None:
    """The index git is committing, when we run inside a git hook (absolute path), else None."""
    value = os.environ.get("GIT_INDEX_FILE")
    if not value:
        return None
    return os.path.abspath(value)  # git may export it relative to the hook's cwd (the top level)


def run(cwd: Path, *args: str, index_file: str | None = None, check: bool = True) -> str:
    """`git ARGS` in `cwd` -> stdout; failure -> RF106 naming the directory (exit 2)."""
    done = run_raw(cwd, *args, index_file=index_file)
    if check and done.returncode != 0:
        raise failed(cwd, args, done.stderr)
    return done.stdout


def run_raw(
    cwd: Path, *args: str, index_file: str | None = None, extra_env: dict | None = None
) -> subprocess.CompletedProcess:
    return finish(start(cwd, *args, index_file=index_file, extra_env=extra_env))


def start(
    cwd: Path, *args: str, index_file: str | None = None, extra_env: dict | None = None
) -> subprocess.Popen:
    """`git ARGS` begun in `cwd`, not waited for: the walk starts a level's calls at once and
    reads them in order (`finish`), so independent git processes overlap."""
    try:
        process = subprocess.Popen(
            ["git", *args],
            cwd=cwd,
            env={**clean_env(index_file, cwd), **(extra_env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="surrogateescape",
        )
    except FileNotFoundError:
        raise RlflowError(
            Diagnostic("RF106", "cannot run git: it is not installed", help="install git")
        ) from None
    STARTED.append(process)
    return process


def reap() -> None:
    """Stop and wait for every process `start` began that nobody read (the walk stopped early)."""
    while STARTED:
        process = STARTED.pop()
        if process.returncode is None:
            process.kill()
            process.communicate()


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    """What `subprocess.run` returns for a process begun by `start`."""
    stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def failed(cwd: Path, args: tuple, stderr: str) -> RlflowError:
    reason = (stderr or "").strip().splitlines()
    return RlflowError(
        Diagnostic(
            "RF106",
            f"`git {' '.join(args[:2])}` failed in `{cwd}`: {reason[-1] if reason else 'no output'}",
            help="check that `git status` works there",
        )
    )
