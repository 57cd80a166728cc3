"""The node launcher's watchdog, stop-signal handshake and reaper, with real rank processes (no
Slurm: the variables srun would set are set here), and the retry decision on real status files.
The same launcher runs under srun in test_launch_recovery.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from rlflow.launch import attempts, preflight

PYTHON = sys.executable
PAYLOADS = Path(__file__).resolve().parent / "payloads"


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
        "rlflow.launch.node",
        "--num-nodes=1",
        f"--ranks-per-node={ranks}",
        f"--log-dir={tmp_path / 'logs'}",
        f"--status-dir={tmp_path / 'status'}",
        "--stop-grace=5",
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
    command = [PYTHON, "-c", "import time; time.sleep(600)"]
    process = start_launcher(tmp_path, command, "--startup-timeout=2", ranks=1)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 77, output
    assert "rank 0 (node1) made no progress for 2 s in phase `startup` at step 0" in output


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


# --- the retry decision (rlflow/launch/attempts.py) on status files as the launchers write them


def _status(tmp_path: Path, attempt: int, files: dict[str, str]) -> Path:
    status = tmp_path / "status" / f"attempt-{attempt}"
    status.mkdir(parents=True)
    for name, text in files.items():
        (status / name).write_text(text)
    return status


def _decide(tmp_path: Path, attempt: int, rc: int, files: dict[str, str], retries: int = 2):
    status = _status(tmp_path, attempt, files)
    args = Namespace(
        run_dir=str(tmp_path),
        status_dir=str(status),
        attempt=attempt,
        job_id="7",
        nodes="node[1-2]",
        rc=rc,
        max_requeues=1,
        max_failure_retries=retries,
    )
    decision, record = attempts.decide(args)
    attempts.append(tmp_path, record)
    return decision, record


def _started(*nodes: str) -> dict[str, str]:
    return {f"node-{i}.started": f"{n} pid 1\n" for i, n in enumerate(nodes)}


def _ended(*nodes: str) -> dict[str, str]:
    return {f"node-{i}.ended": f"{n} exit 0\n" for i, n in enumerate(nodes)}


def test_node_failures_are_retried_with_the_nodes_excluded_until_the_retries_run_out(tmp_path):
    both = {**_started("node1", "node2"), **_ended("node1", "node2")}
    hang = "77\nrank 3 (node2) made no progress for 300 s in phase `logprobs` at step 812\nnode2\n"
    assert _decide(tmp_path, 0, 77, {**both, "first-failure": hang})[0] == "retry node2"
    preflight_failures = {
        **both,
        "first-failure": "78\nrank 0 on node1 (node 0) failed preflight: gpus\nnode1\n",
        "failure-node-0": "78\nx\nnode1\n",
        "failure-node-1": "78\ny\nnode3\n",
    }
    assert _decide(tmp_path, 1, 78, preflight_failures)[0] == "retry node1,node2,node3"
    decision, record = _decide(tmp_path, 2, 137, _started("node4", "node5") | _ended("node4"))
    assert decision == "fail 137"
    assert record.reason.startswith("node node5 lost: its launcher never reported an exit")
    assert record.action == "stop: node-failure retries exhausted (slurm.max_failure_retries=2)"
    assert [r["attempt"] for r in attempts.read_attempts(tmp_path)] == [0, 1, 2]


def test_a_step_slurm_could_not_start_is_retried_without_blaming_a_node(tmp_path):
    decision, record = _decide(tmp_path, 0, 1, {})  # srun failed: no launcher ever started
    assert decision == "retry -" and record.bad_nodes == []
    assert record.reason == "Slurm could not start the step (srun exit 1)"


@pytest.mark.parametrize("code", [1, 2, 137])
def test_errors_of_the_run_itself_are_not_retried(tmp_path, code):
    failure = f"{code}\nrank 0 on node1 (node 0) exited with code {code}; log: x\nnode1\n"
    files = {**_started("node1"), **_ended("node1"), "first-failure": failure}
    decision, record = _decide(tmp_path, 0, code, files)
    assert (decision, record.outcome) == (f"fail {code}", "failed")
    assert record.action == "stop: not retried (a retry would fail the same way)"


def test_time_limit_requeues_are_counted_apart_from_node_failures(tmp_path):
    ok = {**_started("node1"), **_ended("node1"), "stopped-node-0": "x"}
    hang = {**_started("node1"), **_ended("node1"), "first-failure": "77\nh\nnode1\n"}
    assert _decide(tmp_path, 0, 77, hang)[0] == "retry node1"
    assert _decide(tmp_path, 1, 0, ok)[0] == "time-limit 0"  # the retry was no time-limit requeue
    assert _decide(tmp_path, 2, 0, ok)[0] == "time-limit 1"
    assert _decide(tmp_path, 3, 0, {**_started("node1"), **_ended("node1")})[0] == "done"


# --- preflight checks that need no second node


def test_preflight_checks_name_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    monkeypatch.setenv(preflight.TEST_VISIBLE_GPUS_ENV, "node6:4,node7:3")
    assert preflight.check_gpus(4) == ["gpus: 3 GPUs visible, 4 requested"]
    assert preflight.check_gpus(3) == []
    monkeypatch.delenv("RLFLOW_PREFLIGHT_NOPE", raising=False)
    assert preflight.check_env(["HOME", "RLFLOW_PREFLIGHT_NOPE"]) == [
        "env: RLFLOW_PREFLIGHT_NOPE not set (preflight.required_env)"
    ]
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000004" / "model.pt").write_bytes(b"x" * 4096)
    assert preflight.checkpoint_bytes(tmp_path, None) == 4096
    assert preflight.check_disk(tmp_path, 4096, 0.0) == []
    [full] = preflight.check_disk(tmp_path, 2**60, 1.0)
    assert full.startswith("disk: ") and "a checkpoint needs 1073741824.0 GiB" in full
    assert preflight.check_gemm(64, 1e-5, "cpu") == []


def test_a_collective_timeout_shorter_than_the_watchdog_is_refused_by_the_dry_run(tmp_path):
    recipe = Path(__file__).resolve().parent / "recipes" / "tiny-cpu.yaml"
    result = subprocess.run(
        [PYTHON, "-m", "rlflow.cli", "submit", str(recipe), "watchdog.collective_timeout_s=60"]
        + ["slurm.max_failure_retries=-1", "--nodes", "1", "--gpus", "1", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert (
        "`watchdog.collective_timeout_s` (60) is shorter than `watchdog.phase_timeout_s` (600)"
        in result.stderr
    )
    assert "`slurm.max_failure_retries` must be at least 0" in result.stderr
    assert "Traceback" not in result.stderr
