"""The per-node launcher, run as a real process with real child ranks (no Slurm needed: the
variables srun would set are set here). The same launcher runs under srun in
tests/launch/test_launch_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PYTHON = sys.executable


def node_env(node_rank: int = 0, num_nodes: int = 1, hostname: str = "node1") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(
        SLURM_NODEID=str(node_rank),
        SLURM_NNODES=str(num_nodes),
        SLURMD_NODENAME=hostname,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1999",
        SLURM_JOB_ID="77",
    )
    return env


def launch(
    tmp_path: Path,
    rank_code: str,
    *,
    ranks: int = 2,
    num_nodes: int = 1,
    node_rank: int = 0,
    stop_grace: float = 5,
    env: dict | None = None,
) -> subprocess.Popen:
    """Start the launcher; each rank runs `python -c rank_code`."""
    args = [
        PYTHON,
        "-m",
        "rlflow.job.node",
        f"--num-nodes={num_nodes}",
        f"--ranks-per-node={ranks}",
        f"--log-dir={tmp_path / 'logs'}",
        f"--status-dir={tmp_path / 'status'}",
        f"--stop-grace={stop_grace}",
        "--stop-signal=USR1",  # these tests send the warning as Slurm does
        "--",
        PYTHON,
        "-c",
        rank_code,
    ]
    return subprocess.Popen(
        args,
        env=env or node_env(node_rank, num_nodes),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out + err


def wait_for_files(paths: list[Path], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, (
            f"never appeared: {[str(p) for p in paths if not p.exists()]}"
        )
        time.sleep(0.05)


ENV_DUMP = """
import json, os
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"]
print(json.dumps({k: os.environ[k] for k in keys}))
"""


def test_each_rank_gets_its_place_in_the_job_and_its_own_log(tmp_path):
    code, output = finish(
        launch(tmp_path, ENV_DUMP, ranks=3, num_nodes=2, node_rank=1, env=node_env(1, 2, "node2"))
    )
    assert code == 0, output
    seen = {}
    for rank in (3, 4, 5):
        lines = (tmp_path / "logs" / f"rank-{rank}.log").read_text().splitlines()
        assert lines[0].startswith(f"==== rlflow: rank {rank} on node2, job 77 attempt 0")
        seen[rank] = json.loads(lines[1])
    assert seen[4] == {
        "RANK": "4",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "3",
        "NODE_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1999",
    }
    assert [seen[r]["LOCAL_RANK"] for r in (3, 4, 5)] == ["0", "1", "2"]
    assert "started ranks 3-5 of 6" in output
    records = {p.name for p in (tmp_path / "status").iterdir()}
    assert records == {"node-1.started", "node-1.alive", "node-1.ended", "heartbeat"}  # no failure
    assert (tmp_path / "status" / "node-1.alive").read_text().strip().isdigit()


def test_a_failing_rank_stops_its_siblings_and_its_code_is_the_exit_code(tmp_path):
    code = (
        "import os, sys, time\n"
        "if os.environ['LOCAL_RANK'] == '1':\n"
        "    time.sleep(0.5); print('rank 1 gives up', flush=True); sys.exit(7)\n"
        "time.sleep(600)\n"
    )
    process = launch(tmp_path, code, ranks=3)
    exit_code, output = finish(process, timeout=60)  # the siblings sleep 600 s unless stopped
    assert exit_code == 7
    assert "rank 1 exited with code 7; stopping ranks 0,2" in output
    assert "| rank 1 gives up" in output  # the failing rank's log tail, for the batch log
    failure = (tmp_path / "status" / "first-failure").read_text().splitlines()
    assert failure[0] == "7"
    assert failure[1].startswith("rank 1 on node1 (node 0) exited with code 7; log: ")


def test_the_failing_ranks_own_error_report_is_printed_not_its_noise(tmp_path):
    """Rank 1 logs pages of progress, then its report (rlflow/train/main.py's "[rank R] error:"
    line and a long traceback): the launcher prints the report, its middle cut, and no noise."""
    code = (
        "import os, sys, time\n"
        "if os.environ['LOCAL_RANK'] == '1':\n"
        "    print('\\n'.join(f'progress {i}' for i in range(3000)))\n"
        "    print('[rank 1] error: ValueError: the real reason', file=sys.stderr)\n"
        "    print('\\n'.join(f'  frame {i}' for i in range(200)), file=sys.stderr)\n"
        "    print('ValueError: the real reason', file=sys.stderr); sys.exit(1)\n"
        "time.sleep(600)\n"
    )
    exit_code, output = finish(launch(tmp_path, code, ranks=2))
    assert exit_code == 1
    assert "rank 1's error, from " in output
    assert "  | [rank 1] error: ValueError: the real reason" in output
    assert "lines cut: the whole log has them" in output
    assert output.rstrip().endswith("| ValueError: the real reason"), output[-500:]
    assert "progress" not in output


def test_a_rank_killed_by_a_signal_is_named_so(tmp_path):
    """...and an earlier attempt's report in the same (appended) log is not taken for its own."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-0.log").write_text(
        "==== rlflow: rank 0 on node1, job 77 attempt 0 ====\n[rank 0] error: an old reason\n"
    )
    code = (
        "import os, signal, time\n"
        "if os.environ['LOCAL_RANK'] == '0':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(600)\n"
    )
    exit_code, output = finish(launch(tmp_path, code, ranks=2))
    assert exit_code == 137
    assert "rank 0 exited with code 137 (killed by SIGKILL); stopping ranks 1" in output
    assert "rank 0 printed nothing before it stopped" in output
    assert "an old reason" not in output
    failure = (tmp_path / "status" / "first-failure").read_text().splitlines()
    assert failure[1].startswith(
        "rank 0 on node1 (node 0) exited with code 137 (killed by SIGKILL)"
    )


def test_ranks_that_saved_for_a_requeue_leave_a_marker_and_exit_zero(tmp_path):
    code = "import sys, time; time.sleep(0.2); sys.exit(75)"
    exit_code, output = finish(launch(tmp_path, code, ranks=2))
    assert exit_code == 0, output
    assert (tmp_path / "status" / "stopped-node-0").read_text() == "ranks 0,1 on node1 exited 75\n"
    assert not (tmp_path / "status" / "first-failure").exists()


def test_usr1_reaches_every_rank(tmp_path):
    code = (
        "import os, signal, sys, time\n"
        "got = []\n"
        "signal.signal(signal.SIGUSR1, lambda *_: got.append(1))\n"
        "open(os.environ['READY'] + os.environ['RANK'], 'w').close()\n"
        "deadline = time.time() + 60\n"
        "while not got and time.time() < deadline: time.sleep(0.05)\n"
        "sys.exit(75 if got else 3)\n"
    )
    env = {**node_env(), "READY": str(tmp_path / "ready-")}
    process = launch(tmp_path, code, ranks=2, env=env)
    wait_for_files([tmp_path / "ready-0", tmp_path / "ready-1"])
    process.send_signal(signal.SIGUSR1)
    exit_code, output = finish(process)
    assert exit_code == 0, output
    assert "time-limit warning (SIGUSR1): passing it on to the ranks" in output
    assert (tmp_path / "status" / "stopped-node-0").exists()


def test_an_early_warning_neither_kills_a_starting_rank_nor_goes_unheard(tmp_path):
    """The warning arrives while the ranks are still starting (no handler yet, like a trainer
    importing torch): they must not die of it, and hear it once their handler is in place."""
    code = (
        "import os, signal, sys, time\n"
        "open(os.environ['READY'] + os.environ['RANK'], 'w').close()\n"
        "time.sleep(1)  # still starting: the warning comes now\n"
        "got = []\n"
        "signal.signal(signal.SIGUSR1, lambda *_: got.append(1))\n"
        "deadline = time.time() + 60\n"
        "while not got and time.time() < deadline: time.sleep(0.05)\n"
        "sys.exit(75 if got else 3)\n"
    )
    env = {**node_env(), "READY": str(tmp_path / "ready-")}
    process = launch(tmp_path, code, ranks=2, env=env)
    wait_for_files([tmp_path / "ready-0", tmp_path / "ready-1"])
    process.send_signal(signal.SIGUSR1)
    exit_code, output = finish(process)
    assert exit_code == 0, output
    assert (tmp_path / "status" / "stopped-node-0").read_text() == "ranks 0,1 on node1 exited 75\n"


def test_ranks_that_ignore_a_requeue_are_stopped_after_the_grace(tmp_path):
    code = (
        "import os, sys, time\nif os.environ['LOCAL_RANK'] == '0': sys.exit(75)\ntime.sleep(600)\n"
    )
    exit_code, output = finish(launch(tmp_path, code, ranks=2, stop_grace=1))
    assert exit_code == 128 + signal.SIGTERM
    assert "ranks 1 still run 1s after a rank stopped for a requeue: stopping them" in output
    assert (tmp_path / "status" / "first-failure").read_text().startswith("143\nrank 1 ")


def test_sigterm_stops_the_ranks(tmp_path):
    code = (
        "import os, time\n"
        "open(os.environ['READY'] + os.environ['RANK'], 'w').close()\n"
        "time.sleep(600)\n"
    )
    env = {**node_env(), "READY": str(tmp_path / "ready-")}
    process = launch(tmp_path, code, ranks=2, env=env)
    wait_for_files([tmp_path / "ready-0", tmp_path / "ready-1"])
    process.send_signal(signal.SIGTERM)
    exit_code, output = finish(process)
    assert exit_code == 128 + signal.SIGTERM
    assert "SIGTERM: stopping the ranks" in output


def test_a_command_that_cannot_start_fails_with_127(tmp_path):
    args = [
        PYTHON,
        "-m",
        "rlflow.job.node",
        "--num-nodes=1",
        "--ranks-per-node=2",
        f"--log-dir={tmp_path / 'logs'}",
        f"--status-dir={tmp_path / 'status'}",
        "--stop-grace=5",
        "--stop-signal=USR1",  # these tests send the warning as Slurm does
        "--",
        "no-such-program-xyz",
        "--flag",
    ]
    done = subprocess.run(args, env=node_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 127
    assert "cannot run 'no-such-program-xyz'" in (tmp_path / "logs" / "rank-0.log").read_text()
    assert (tmp_path / "status" / "first-failure").read_text().startswith("127\n")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"SLURM_NODEID": ""}, "SLURM_NODEID is not set: the launcher runs under srun"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
        ({"SLURM_NNODES": "3"}, "this step runs on 3 nodes, but the job was planned for 1"),
        (
            {"RLFLOW_HEAD_NODE": "node9"},
            "node rank 0 runs on node1, but MASTER_ADDR points at node9",
        ),
    ],
)
def test_a_wrong_environment_is_refused_before_any_rank_starts(tmp_path, change, message):
    env = {**node_env(), **change}
    exit_code, output = finish(launch(tmp_path, "print('ran')", env=env))
    assert exit_code == 2
    assert message in output
    assert not (tmp_path / "logs").exists()
