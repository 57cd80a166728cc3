"""The node launcher's watchdog, stop-signal handshake and reaper, with real rank processes (no
Slurm: the variables srun would set are set here). The same launcher runs under srun in
test_job_recovery.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

PYTHON = sys.executable
PAYLOADS = Path(__file__).resolve().parents[1] / "launch" / "payloads"


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def start_launcher(tmp_path: Path, command: list[str], *extra: str, ranks: int = 2, env=None):
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("SLURM")}
    env.update(
        SLURM_NODEID="0",
        SLURM_NNODES="1",
        SLURMD_NODENAME="node1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=free_port(),
    )
    args = [
        PYTHON,
        "-m",
        "rlflow.job.node",
        "--num-nodes=1",
        f"--ranks-per-node={ranks}",
        f"--log-dir={tmp_path / 'logs'}",
        f"--status-dir={tmp_path / 'status'}",
        "--stop-grace=5",
        "--stop-signal=USR1",  # these tests send the warning as Slurm does
        *extra,
        "--",
        *command,
    ]
    return subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def report(tmp_path: Path, rank: int) -> dict | None:
    try:
        return json.loads((tmp_path / "status" / "heartbeat" / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def wait_for_report(tmp_path: Path, rank: int, ready, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beat = report(tmp_path, rank)
        if beat is not None and ready(beat):
            return beat
        time.sleep(0.02)
    pytest.fail(f"rank {rank} never got there: {report(tmp_path, rank)}")


def test_a_stopped_rank_is_named_and_every_local_stack_shows_where_it_was_blocked(tmp_path):
    """Rank 1 is SIGSTOPped inside compute(); rank 0 then waits in exchange_gradients() (a gloo
    all-reduce). Both dumps must be real: the functions each rank was blocked in."""
    out = tmp_path / "out"
    out.mkdir()
    timeout = 10  # generous: a busy 2-core machine can stall a healthy rank for seconds
    command = [PYTHON, str(PAYLOADS / "progress.py"), str(out), "50", str(timeout), "2"]
    process = start_launcher(tmp_path, command)
    beat = wait_for_report(tmp_path, 1, lambda b: b["phase"] == "compute" and b["step"] >= 2)
    os.kill(beat["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    output, _ = process.communicate(timeout=timeout + 60)
    assert process.returncode == 77, output
    assert time.monotonic() - stopped < timeout + 60
    failure = (tmp_path / "status" / "first-failure").read_text().splitlines()
    assert failure[0] == "77" and failure[2] == "node1"
    assert re.match(
        r"rank 1 \(node1\) made no progress for \d+ s in phase `compute` at step \d+; ", failure[1]
    )
    hang = (tmp_path / "logs" / "hang-attempt0-node0.txt").read_text()
    assert f"stacks: {tmp_path / 'logs' / 'hang-attempt0-node0.txt'}" in failure[1]
    rank0, rank1 = hang.split("==== rank 1 ")
    assert "process state T" in rank1  # it was stopped, and still answered (SIGCONT)
    # The stopped rank's dump is taken when it continues (SIGCONT after SIGUSR2): usually still
    # inside compute(), but 1 run in 4 here it showed the next line of main() (the sleep had
    # expired while stopped). Either way it is the real stack of that process, innermost first.
    assert "progress.py" in rank1 and " in main\n" in rank1
    if " in compute\n" in rank1:
        assert rank1.index(" in compute\n") < rank1.index(" in main\n")
    assert " in exchange_gradients\n" in rank0 and " in all_reduce\n" in rank0
    assert "(most recent call first)" in rank0  # faulthandler's own format: a real dump
    assert " in main\n" in (tmp_path / "logs" / "rank-1.log").read_text()  # in the rank log too


def test_a_rank_that_never_reports_is_ended_after_the_startup_timeout(tmp_path):
    """It answers the dump signal as a trainer does (faulthandler, rlflow/train/watchdog.py), so
    the launcher has its stack at once instead of waiting out DUMP_WAIT_SECONDS for it."""
    code = (
        "import faulthandler, signal, sys, time\n"
        "faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)\n"
        "time.sleep(600)\n"
    )
    process = start_launcher(tmp_path, [PYTHON, "-c", code], "--startup-timeout=2", ranks=1)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 77, output
    assert "rank 0 (node1) made no progress for 2 s in phase `startup` at step 0" in output
    assert " in <module>\n" in (tmp_path / "logs" / "hang-attempt0-node0.txt").read_text()


def test_a_rank_that_heard_the_warning_is_not_signalled_again_nor_killed_while_it_exits(tmp_path):
    """Rank 0 acknowledges the warning (rlflow.train.signals.StopRequest), saves for 7 s and,
    while it exits, gets the warning again and again (a flood of SIGUSR1 from outside):
    it must exit 75, not die of signal 10 during interpreter shutdown."""
    code = (
        "import os, signal, subprocess, sys, time\n"
        "from rlflow.train import watchdog\n"
        "from rlflow.train.signals import StopRequest\n"
        "watchdog.start()\n"
        "stop = StopRequest(True, 'USR1')\n"
        "count = []\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: (count.append(1), stop._handle(s, f)))\n"
        "open(os.environ['READY'] + os.environ['RANK'], 'w').close()\n"
        "while not count: time.sleep(0.05)\n"
        "time.sleep(7)  # saving: the launcher repeats the warning every 5 s to ranks that did not hear it\n"
        "open(os.environ['READY'] + 'count' + os.environ['RANK'], 'w').write(str(len(count)))\n"
        "stop.stopping()\n"
        "subprocess.Popen(['bash', '-c', f'while kill -USR1 {os.getpid()} 2>/dev/null; do :; done'])\n"
        "time.sleep(0.2)\n"
        "sys.exit(75)\n"
    )
    env = {**os.environ, "READY": str(tmp_path / "ready-")}
    process = start_launcher(tmp_path, [PYTHON, "-c", code], ranks=2, env=env)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR1)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output  # both ranks exited 75: saved and stopped
    assert (tmp_path / "status" / "stopped-node-0").read_text() == "ranks 0,1 on node1 exited 75\n"
    assert [(tmp_path / f"ready-count{r}").read_text() for r in (0, 1)] == ["1", "1"]


def test_the_ranks_and_their_children_die_with_a_killed_launcher(tmp_path):
    """SIGKILL leaves the launcher no time to stop anything: PR_SET_PDEATHSIG takes its direct
    children, the reaper the grandchildren (here the python under a bash wrapper)."""
    code = "import os, time; open(os.environ['READY'] + os.environ['RANK'], 'w').write(str(os.getpid())); time.sleep(600)"
    command = ["bash", "-c", f'{PYTHON} -c "{code}"; echo done']
    env = {**os.environ, "READY": str(tmp_path / "pid-")}
    process = start_launcher(tmp_path, command, ranks=2, env=env)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid-{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)
    ranks = [int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1)]
    process.kill()
    process.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, f"orphans left: {[p for p in ranks if _alive(p)]}"
        time.sleep(0.1)
    assert not (tmp_path / "status" / "node-0.ended").exists()  # what a lost node looks like


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_rank_log_that_is_not_a_file_is_never_waited_on(tmp_path, kind):
    """Issue 36, item 4: the launcher reads a failed rank's log tail (its error report) and a
    hang's stack dumps from logs/rank-<R>.log; a named pipe put there made it wait forever, a
    link to /dev/zero made the dump copy fill the memory. In a child with a timeout and an
    address-space limit, so a regression fails the test rather than the host."""
    import resource

    log = tmp_path / "rank-0.log"
    if kind == "fifo":
        os.mkfifo(log)
        what = "it is a named pipe (FIFO), not a regular file"
    else:
        log.symlink_to("/dev/zero")
        what = "it links to /dev/zero, which is a character device, not a regular file"
    probe = (
        "import sys\nfrom pathlib import Path\nfrom rlflow.job import dumps, ranks\n"
        "print(repr(ranks.read_tail(Path(sys.argv[1]), 1 << 20)))\n"
        "print(dumps._read_from(Path(sys.argv[1]), 0))\n"
    )
    memory = 2 << 30
    done = subprocess.run(
        [PYTHON, "-c", probe, str(log)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (memory, memory)),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"''\n(not read: {what})\n\n"
