"""CI files -> shards: the pytest argument lists CI really runs, each with where it is written.

Read, in a repository:

    .github/workflows/*.yml|yaml  each step's `run:` lines that call pytest; `${{ matrix.x }}`
                                  is expanded over the job's `strategy.matrix` (lists, include,
                                  exclude), one shard per combination
    shell scripts                 everything under `.ci/` or `ci/`, and the scripts a workflow
                                  step or such a script calls (`bash x.sh`, `./x.sh`), from the
                                  call's directory, with its environment
    Makefiles                     the recipes of the targets a line runs (`make test`)
    ci-shards.yaml                for other CI systems (documented in the README), and `for:`
                                  what a command check-tests cannot follow runs:
                                      shards:
                                        - name: unit
                                          args: ["tests/unit", "-m", "not gpu"]
                                        - name: tox
                                          for: "tox -e py"
                                          args: "tests/gpu -k cuda"

Lines are split by shell.py (shell words; `cd`, env prefixes, wrappers); the arguments after
pytest are kept exactly as written, for pytest's own parser (collect.py). A line whose arguments
still hold a shell variable (`$TESTS`), or that runs pytest in a way shell.py does not follow
(`docker run img pytest`, `tox` whose config mentions pytest), cannot be read: RF201, exit 2
naming it, unless ci-shards.yaml describes it (`for:`). A matrix over 256 jobs,
a `steps` or `exclude` that is not a list, a file that is not UTF-8 or a quote left open are
malformed input (RF200, exit 2, file and line).

This module finds the CI files and follows the calls between them; the readers are
workflows.py (GitHub Actions), scripts.py (shell scripts, Makefiles) and shard.py (the `Shard`
model, ci-shards.yaml, the shared RF200/RF201 helpers).
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

from rlflow.cicheck.scripts import make_shards, script_shards
from rlflow.cicheck.shard import (
    DESCRIBED,
    SHARDS_FILE,
    Shard,
    cannot_tell,
    norm,
    read_bytes,
    spoken,
    yaml_shards,
)
from rlflow.cicheck.shell import MakeCall, ScriptCall
from rlflow.cicheck.workflows import workflow_shards


def find_shards(root: Path, tracked: list[str]) -> list[Shard]:
    """Workflows, the scripts CI runs (under .ci/ or ci/, or called from a workflow or from such
    a script, from the directory and with the environment of the call), the make targets they
    run, and ci-shards.yaml. A tracked script nothing runs is not a shard."""
    described = yaml_shards(root, SHARDS_FILE) if os.path.lexists(root / SHARDS_FILE) else []
    DESCRIBED.clear()
    DESCRIBED.update(spoken(c) for shard in described for c in shard.describes)
    try:
        return _find_shards(root, tracked) + described
    finally:
        DESCRIBED.clear()


def _find_shards(root: Path, tracked: list[str]) -> list[Shard]:
    shards: list[Shard] = []
    tracked_set = set(tracked)
    calls: list = [ScriptCall(t, "", ()) for t in tracked if t.startswith((".ci/", "ci/"))]
    calls = [c for c in calls if _is_shell(root, c.path)]
    for rel in tracked:
        name = rel.removeprefix(".github/workflows/")
        if name != rel and "/" not in name and rel.endswith((".yml", ".yaml")):  # as GitHub
            found, called = workflow_shards(root, rel)
            shards += found
            calls += called
    seen = set()
    while calls:
        call = calls.pop(0)
        if call in seen or len(seen) > 10_000:
            continue
        seen.add(call)
        if isinstance(call, MakeCall):
            found, called = make_shards(root, call, tracked_set)
        else:
            rel = norm(posixpath.join(call.cwd, call.path))
            if rel not in tracked_set:
                continue  # not a file of the repository (a tool on PATH, a generated file)
            if call.command or not _is_shell(root, rel, called=True):
                _not_sh(root, rel, call)
                continue
            found, called = script_shards(root, rel, call.cwd, call.env)
        shards += found
        calls += [c for c in called if c not in seen]
    return shards


# other CI systems' files: check-tests does not read them (RF205 where one names pytest)
OTHER_CI = (
    ".gitlab-ci.yml", ".circleci/config.yml", "Jenkinsfile", "azure-pipelines.yml",
    ".travis.yml", "bitbucket-pipelines.yml", ".drone.yml", "appveyor.yml", ".woodpecker.yml",
    "buildkite.yml", ".buildkite/pipeline.yml", "cloudbuild.yaml", ".cirrus.yml",
)  # fmt: skip


def unread_ci(root: Path, tracked: list[str]) -> list[str]:
    found = []
    for rel in sorted(set(tracked)):
        if rel in OTHER_CI or rel.startswith((".gitlab/ci/", ".buildkite/", ".circleci/")):
            try:
                text = read_bytes(root / rel, rel).decode("utf-8", "replace")
            except OSError:
                continue
            if "pytest" in text or "py.test" in text:
                found.append(rel)
    return found


def _is_shell(root: Path, rel: str, called: bool = False) -> bool:
    """A file under .ci/ or ci/ (or one a line runs: `called`) that is a shell script: `.sh`/
    `.bash`, or no extension and no other interpreter's `#!` (config files, Python, Dockerfiles
    there are not read as sh). A FIFO, device or huge file there is RF200 (shard.read_bytes)."""
    path = root / rel
    try:
        data = read_bytes(path, rel)
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    if path.suffix in (".sh", ".bash"):
        return True
    if path.suffix and called and path.suffix != ".py":
        return True  # `./run.ci`: the shell runs it by its `#!`, read as sh below
    if path.suffix or path.name.startswith(".") or path.name in ("Dockerfile", "Makefile"):
        return False
    first = data[:200].partition(b"\n")
    first = first[0] + first[1]  # the first line as `readline(200)` returns it
    return not first.startswith(b"#!") or any(
        shell in first for shell in (b"sh\n", b"bash", b"/sh ", b"env sh", b"zsh", b"dash")
    )


def _not_sh(root: Path, rel: str, call: ScriptCall) -> None:
    """A script CI runs that is not sh (Python): check-tests cannot tell what it runs, which
    matters only where it names pytest."""
    try:
        text = read_bytes(root / rel, rel).decode("utf-8", "replace")
    except OSError:
        return
    if "pytest" in text or "py.test" in text:
        cannot_tell(
            rel,
            None,
            call.command or call.path,
            f"`{rel}` is not a shell script, and it names pytest",
        )
