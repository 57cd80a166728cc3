"""`rlflow check-tests`: every test that no CI shard collects, with its file.

Exit codes: 0 every test is collected by some shard, 1 some are not (RF210), 2 unusable input
(a CI file that cannot be read, a shard command that cannot be resolved, a collection error).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import click

from rlflow.errors import (
    EXIT_FINDINGS,
    EXIT_OK,
    Diagnostic,
    RlflowError,
    print_diagnostics,
    summary_line,
)
from rlflow.pins.command import repo_option

EPILOG = """\b
Shards are read from .github/workflows/*.yml (each `run:` that calls pytest, the job's matrix
expanded, working-directory and env honoured), the scripts CI runs (.ci/*, ci/*, and scripts a
workflow or such a script calls), the make targets they run, and ci-shards.yaml (whose `for:`
says what a command check-tests cannot follow runs). Each is collected by the real `pytest
--collect-only` with its own arguments, directory and environment. Codes: RF200 malformed CI
file, RF201 shard command that cannot be resolved, RF202 pytest collection failed, RF203 no
tests collected from a non-empty suite, RF204 (warning) a shard whose options run no test
(`--co`), RF205 (warning) another CI system's file names pytest, RF206 (warning) test files a
plain `pytest` does not collect, RF207 (warning) tests addopts deselects and no shard selects,
RF210 tests no shard collects.
"""
COLLECT_TIMEOUT_S = 300.0  # a blocking conftest.py must not hang a commit (or CI) for long:
# 20x what this repository's ~14 s collection takes, a tenth of the 30 minutes it was


@click.command("check-tests", epilog=EPILOG)
@repo_option
@click.option(
    "--pytest",
    "pytest_command",
    default=None,
    help="How to run pytest, e.g. 'uv run pytest'.  [default: this Python's `-m pytest`]",
)
@click.option(
    "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True
)
@click.option(
    "--collect-timeout",
    type=click.FloatRange(min=1, max=86400),
    default=COLLECT_TIMEOUT_S,
    show_default=True,
    help="Seconds one `pytest --collect-only` may take before it is stopped (RF202).",
)
@click.pass_context
def check_tests(
    ctx: click.Context, repo: Path, pytest_command: str | None, fmt: str, collect_timeout: float
) -> None:
    """List every test that no CI shard collects.

    Reads the shards CI runs, collects each with the real `pytest --collect-only`, and
    compares with what a plain `pytest --collect-only` finds. A shard without any selection
    (a bare `pytest`) collects everything: then nothing needs collecting.
    """
    pytest = shlex.split(pytest_command) if pytest_command else [sys.executable, "-m", "pytest"]
    try:
        ctx.exit(run(repo, pytest, fmt, collect_timeout))
    except RlflowError as err:
        print_diagnostics(err.diagnostics, fmt="json" if fmt == "json" else "text")
        ctx.exit(err.exit_code)


def run(repo: Path, pytest: list[str], fmt: str, timeout: float = COLLECT_TIMEOUT_S) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from rlflow.cicheck.collect import collect
    from rlflow.cicheck.shard import SHARDS_FILE
    from rlflow.cicheck.shards import find_shards, unread_ci
    from rlflow.pins import gitcmd
    from rlflow.pins.walk import find_root

    root = find_root(repo)
    tracked = gitcmd.run(root, "ls-files", "-z").split("\0")
    tracked += [
        p
        for p in gitcmd.run(root, "ls-files", "-z", "--others", "--exclude-standard").split("\0")
        if p
    ]
    shards = find_shards(root, sorted(set(filter(None, tracked))))
    unread = [] if (root / SHARDS_FILE).is_file() else unread_ci(root, tracked)
    if not shards:
        raise RlflowError(
            Diagnostic(
                "RF201",
                "no CI shard runs pytest: looked in .github/workflows/, shell scripts, .ci/, ci/ "
                f"and {SHARDS_FILE}",
                help=f"describe your CI's test shards in {SHARDS_FILE} (docs/lockstep.md: check-tests)",
                notes=tuple(f"not read: `{u}` names pytest" for u in unread),
            )
        )
    info: dict = {}
    universe = collect(root, pytest, (), "the whole test suite", info=info, timeout=timeout)
    outside = _outside(tracked, info)
    if not universe:
        files = [t for t in tracked if _is_test_file(t)]
        if files:
            raise RlflowError(
                Diagnostic(
                    "RF203",
                    f"`pytest --collect-only` collects 0 tests, but {len(files)} test files "
                    f"are tracked (e.g. `{files[0]}`)",
                    help="check testpaths/python_files in the pytest configuration; an empty "
                    "suite is never a pass",
                )
            )
    unique = {}
    for shard in shards:
        unique.setdefault((shard.args, shard.cwd, shard.env), shard.name)
    notes: list[str] = []
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = pool.map(
            lambda key: collect(
                root, pytest, key[0], unique[key], key[1], key[2], notes, timeout=timeout
            ),
            list(unique),
        )
        covered = set().union(*results)
    missing = sorted(universe - covered)
    deselected = sorted(info.get("deselected", set()) - covered)
    return _report(
        fmt, missing, shards, len(universe), None, sorted(notes), unread, outside, deselected
    )


def _outside(tracked: list[str], info: dict) -> list[str]:
    """Tracked files named like test modules (python_files) that a plain `pytest` does not
    collect: outside testpaths, or left out by norecursedirs, collect_ignore, --ignore."""
    from fnmatch import fnmatch

    patterns = info.get("python_files") or ["test_*.py", "*_test.py"]
    modules = info.get("modules", set())
    return sorted(
        path
        for path in set(tracked)
        if path.endswith(".py")
        and path not in modules
        and any(
            fnmatch(path.rsplit("/", 1)[-1], p) if "/" not in p else fnmatch(path, "*" + p)
            for p in patterns
        )
    )


def _is_test_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def _report(
    fmt: str,
    missing: list[str],
    shards,
    total: int | None,
    reason: str | None,
    notes=(),
    unread=(),
    outside=(),
    deselected=(),
) -> int:
    by_file: dict[str, list[str]] = defaultdict(list)
    for node in missing:
        by_file[node.split("::", 1)[0]].append(node.split("::", 1)[1])
    diagnostics = [
        Diagnostic(
            "RF210",
            f"{len(tests)} test{'s' * (len(tests) != 1)} in {file} "
            f"{'are' if len(tests) != 1 else 'is'} collected by no CI shard",
            file=file,
            notes=(
                ", ".join(tests[:20])
                + (f", ... ({len(tests) - 20} more)" if len(tests) > 20 else ""),
            ),
            help=f"add `{file}` to a shard's pytest paths (or widen its -k/-m), or delete the tests",
        )
        for file, tests in sorted(by_file.items())
    ]
    code = EXIT_FINDINGS if diagnostics else EXIT_OK
    diagnostics += [
        Diagnostic(
            "RF204",
            note,
            severity="warning",
            help="drop that option from the CI line (or addopts) if the line should run tests",
        )
        for note in notes
    ] + [
        Diagnostic(
            "RF205",
            f"`{file}` names pytest, and check-tests does not read it: the tests its jobs "
            "run are not counted",
            severity="warning",
            file=file,
            help="describe its test jobs in ci-shards.yaml (docs/lockstep.md: check-tests)",
        )
        for file in unread
    ]
    if deselected:
        diagnostics.append(
            Diagnostic(
                "RF207",
                f"{len(deselected)} test{'s' * (len(deselected) != 1)} that the pytest "
                "configuration itself deselects (-k, -m or --deselect in addopts) "
                f"{'are' if len(deselected) != 1 else 'is'} selected by no CI shard either",
                severity="warning",
                notes=(", ".join(deselected[:10]) + (", ..." if len(deselected) > 10 else ""),),
                help="if CI should run them, add a shard that selects them (`-m slow`); "
                "a plain `pytest` is what check-tests counts as the suite",
            )
        )
    if outside:
        diagnostics.append(
            Diagnostic(
                "RF206",
                f"{len(outside)} tracked test file{'s' * (len(outside) != 1)} that a plain "
                "`pytest` does not collect (testpaths, norecursedirs, collect_ignore or "
                "--ignore leave them out) are not checked",
                severity="warning",
                notes=(", ".join(outside[:10]) + (", ..." if len(outside) > 10 else ""),),
                help="if CI should run them, widen testpaths (or the ignores); a plain "
                "`pytest` is what check-tests counts as the suite",
            )
        )
    checked = f"{len(shards)} shard{'s' * (len(shards) != 1)}" + (
        f", {total} tests" if total is not None else f" ({reason})"
    )
    if fmt == "json":
        print(
            json.dumps(
                {
                    "diagnostics": [d.to_json() for d in diagnostics],
                    "uncollected": missing,
                    "shards": [{"name": s.name, "args": list(s.args)} for s in shards],
                    "checked": checked,
                    "exit_code": code,
                },
                indent=2,
            )
        )
        return code
    for diagnostic in diagnostics:
        print(diagnostic.render())
        print()
    print(
        f"{summary_line(diagnostics)} ({checked})"
        if code
        else f"ok: {checked}, every test is collected"
    )
    return code
