"""Bounded reads (rlflow/bounded.py) in every command that reads a file others put in place
(issue 36, item 4): a named pipe where a run-directory, metrics or CI file belongs once made
`status`, `cancel`, `report` wait forever, a link to /dev/zero made them fill the memory, and
`check-tests` waited 30 minutes on a conftest.py that blocks. Each is now exit 2 naming the file
and what it is, at once. Through the console script; each run has a timeout (a hang fails the
test) and an address-space limit (a read of /dev/zero fails it with MemoryError, not the host).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pins.pins_helpers import git, make_repo

RLFLOW = Path(sys.executable).parent / "rlflow"
MEMORY = 4 << 30  # far above what these commands need, far below what /dev/zero offers


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def rlflow(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(RLFLOW), *args],
        cwd=cwd,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_limited,
    )
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done


def put(path: Path, kind: str) -> str:
    """A named pipe, or a link to /dev/zero, at `path`; what the error then says it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
        return "is a named pipe (FIFO), not a regular file"
    path.symlink_to("/dev/zero")
    return "links to /dev/zero, which is a character device, not a regular file"


@pytest.mark.parametrize("kind", ["fifo", "zero"])
@pytest.mark.parametrize("command", ["status", "cancel"])
def test_status_and_cancel_name_a_launcher_record_that_is_not_a_file(tmp_path, command, kind):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    what = put(run / "launcher.json", kind)
    done = rlflow(command, str(run), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error[jobs.damaged-file]: {run}/launcher.json: {what}" in done.stderr


def test_status_names_a_file_over_its_size_limit(tmp_path):
    """attempts.jsonl grown to 100 MiB (sparse: no disk used) is not read into memory."""
    run = tmp_path / "run"
    (run / "status").mkdir(parents=True)  # a local run's folder of attempts
    with open(run / "attempts.jsonl", "wb") as out:
        out.truncate(100 << 20)
    done = rlflow("status", str(run), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        f"error[jobs.damaged-file]: {run}/attempts.jsonl: is 100.0 MiB, over 8.0 MiB, the most "
        "rlflow reads of it"
    ) in done.stderr


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_report_names_a_metrics_file_that_is_not_a_file(tmp_path, kind):
    what = put(tmp_path / "run" / "metrics.jsonl", kind)
    done = rlflow("report", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error[report.unreadable]: cannot read {tmp_path}/run/metrics.jsonl: it {what}" in (
        done.stderr
    )
    assert not (tmp_path / "run" / "plots").exists()


@pytest.mark.parametrize(
    ("rel", "target", "what"),
    [
        (".github/workflows/ci.yml", "/dev/zero", "/dev/zero, which is a character device, not "),
        ("ci-shards.yaml", "/dev/zero", "/dev/zero, which is a character device, not "),
        ("ci-shards.yaml", "/nonexistent", "/nonexistent, which does not exist"),
    ],
)
def test_check_tests_names_a_ci_file_that_is_not_a_file(tmp_path, rel, target, what):
    """A workflow linked to /dev/zero filled the memory; a ci-shards.yaml that is not a file
    was skipped without a word."""
    root = make_repo(
        tmp_path / "demo",
        {"tests/test_a.py": "def test_a():\n    pass\n", ".ci/run": "#!/bin/sh\npytest\n"},
    )
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).symlink_to(target)
    git(root, "add", "-A")
    git(root, "commit", "-qm", "a CI file that is a link")
    done = rlflow("check-tests", "--repo", str(root), cwd=root)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error[RF200]: malformed `{rel}`: cannot be read: it links to {what}" in done.stderr


def test_check_tests_stops_a_collection_that_blocks(tmp_path):
    """A conftest.py that waits forever (on a named pipe no one writes), after starting a child
    that holds pytest's output open: --collect-timeout stops both, RF202 says what to do."""
    pipe = tmp_path / "never-written"
    os.mkfifo(pipe)
    conftest = (
        "import subprocess\n"
        f"child = subprocess.Popen(['sleep', '3600'])\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        f"open({str(pipe)!r}).read()\n"
    )
    root = make_repo(
        tmp_path / "demo",
        {
            "tests/test_a.py": "def test_a():\n    pass\n",
            "tests/conftest.py": conftest,
            ".ci/run": "#!/bin/sh\npytest tests\n",
        },
    )
    done = rlflow("check-tests", "--repo", str(root), "--collect-timeout", "3", cwd=root)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        "error[RF202]: `pytest --collect-only` for the whole test suite did not finish in 3 s"
        in (done.stderr)
    )
    assert "--collect-timeout SECONDS" in done.stderr
    child = int((tmp_path / "child.pid").read_text())
    state = Path(f"/proc/{child}/stat")
    assert not state.exists() or state.read_text().split(") ")[1].startswith("Z"), "left running"
