"""`rlflow status`, `status --watch`, `logs` and `cancel` on a local run (`rlflow train --nproc N`,
rlflow/launch/local.py), through the CLI, against the real launcher (rlflow/job/local.py) with
stand-in ranks (no torch) that report heartbeats and metrics as the trainer does and save on the
stop signal. tests/job/test_job_local_resume.py runs the real trainer under that launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.slurm.jobs import RECIPES, rlflow

PYTHON = sys.executable
TINY = str(RECIPES / "tiny-cpu.yaml")
# A rank at step 3 of 5: it writes its heartbeat (rlflow/train/watchdog.py's record) and, as
# rank 0, two metrics lines; on SIGUSR1 (the launcher's ask to save) it exits 75.
RANK = """
import json, os, signal, sys, time
from pathlib import Path
run, rank = Path(sys.argv[1]), os.environ["RANK"]
signal.signal(signal.SIGUSR1, lambda *_: os._exit(75))
beat = Path(os.environ["RLFLOW_HEARTBEAT_FILE"])
beat.parent.mkdir(parents=True, exist_ok=True)
beat.write_text(json.dumps({"phase": "rollout", "step": 3, "time": 1.0, "wall": time.time()}))
if rank == "0":
    with open(run / "metrics.jsonl", "a") as out:
        for step in (1, 2):
            out.write(json.dumps({"step": step, "time/step": 2.0, "train/reward": 0.25 * step}))
            out.write("\\n")
    (run / "recipe.resolved.yaml").write_text("grpo:\\n  max_num_steps: 5\\n")
# generation.server.enabled: each rank's record (rlflow/serve/job.py writes these)
from rlflow.serve.registry import publish
if rank == "0":
    publish(run, 0, "http://127.0.0.1:8000/v1", 2, "ready")
else:
    publish(run, 1, None, None, "failed", "RuntimeError: weight sync 0 tore")
print("rank", rank, "at step 3", flush=True)
open(os.environ["MARK"] + "ready-" + rank, "w").close()
while True:
    time.sleep(3600)
"""
LOCAL = (
    "import sys\nfrom pathlib import Path\nfrom rlflow.job.local import run_local\n"
    "sys.exit(run_local([sys.executable, '-c', sys.argv[2], sys.argv[1]], 2, Path(sys.argv[1]),"
    " startup_timeout=None, stop_signal='USR1',"
    " resume_command=['rlflow', 'train', 'tiny.yaml', '--run-dir', sys.argv[1], '--nproc', '2']))"
)


def start(tmp_path: Path, run: Path) -> subprocess.Popen:
    skip = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in skip and not k.startswith("SLURM")}
    for mark in tmp_path.glob("mark-*"):
        mark.unlink()
    return subprocess.Popen(
        [PYTHON, "-c", LOCAL, str(run), RANK],
        env={**env, "MARK": str(tmp_path / "mark-")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_ready(tmp_path: Path, process: subprocess.Popen) -> None:
    """Until both ranks have reported (their own marks); the timeout is a hang guard."""
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"mark-ready-{r}").exists() for r in (0, 1)):
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.05)


def no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.stderr


def test_status_logs_and_cancel_of_a_local_run_then_its_resume(tmp_path):
    run = tmp_path / "run"
    process = start(tmp_path, run)
    try:
        wait_ready(tmp_path, process)
        status = rlflow("status", str(run), cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        head = status.stdout.splitlines()[0]
        assert head.startswith("local run run: RUNNING, attempt 0, since "), head
        assert f"launcher pid {process.pid} on " in head and ", 2 ranks" in head
        assert "  command: rlflow train tiny.yaml --run-dir " in status.stdout
        assert "  phase:   rollout, step 3 of 5 (attempt 0, 2 ranks reporting" in status.stdout
        assert "  metrics: step 2 of 5 logged; " in status.stdout
        assert (
            "  server:  rank 0 http://127.0.0.1:8000/v1 (ready, weight version 2)\n"
            "  server:  rank 1 (no URL yet) (failed): RuntimeError: weight sync 0 tore\n"
        ) in status.stdout

        logs = rlflow("logs", str(run), "--rank", "1", cwd=tmp_path)
        assert logs.returncode == 0, logs.stderr
        assert "rank 1 at step 3" in logs.stdout
        batch = rlflow("logs", str(run), "--batch", cwd=tmp_path)
        assert batch.returncode == 2
        assert batch.stderr.startswith("error[jobs.no-batch-log]: ")

        cancel = rlflow("cancel", str(run), cwd=tmp_path)
        assert cancel.returncode == 0, cancel.stderr
        assert cancel.stdout.startswith("asked local run run to stop (SIGTERM to its launcher")
        assert process.wait(timeout=120) == 75
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    stopped = rlflow("status", str(run), cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith(
        "local run run: STOPPED, attempt 0 saved and stopped on SIGTERM"
    )
    assert "    0: stopped on " in stopped.stdout
    assert "  resume:  `rlflow train tiny.yaml --run-dir " in stopped.stdout
    again = rlflow("cancel", str(run), cwd=tmp_path)
    assert again.returncode == 0
    assert again.stdout.startswith("local run run is not running (STOPPED): nothing to cancel")

    # The same command again is attempt 1; `status --watch` follows it until it stops.
    process, watch = start(tmp_path, run), None
    try:
        wait_ready(tmp_path, process)
        watch = subprocess.Popen(
            [PYTHON, "-m", "rlflow.cli", "status", str(run), "--watch", "--interval", "0.2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert rlflow("cancel", str(run), cwd=tmp_path).returncode == 0
        assert process.wait(timeout=120) == 75
        out, err = watch.communicate(timeout=120)
    finally:
        for p in (process, watch):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert watch.returncode == 1, err
    assert "rlflow: local run run ended: STOPPED" in err
    assert "launcher:   STOPPED, attempt 1 saved and stopped on SIGTERM" in out
    assert (
        "attempts:   now attempt 1; 0 time-limit requeues, 0 node-failure retries, 2 stopped" in out
    )
    records = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["outcome"], r["exit_code"]) for r in records] == [
        (0, "stopped", 75),
        (1, "stopped", 75),
    ]


def test_a_second_launcher_is_refused_and_a_killed_one_is_gone(tmp_path):
    run = tmp_path / "run"
    process = start(tmp_path, run)
    pids = []
    try:
        wait_ready(tmp_path, process)
        pids = [json.loads(p.read_text()) for p in [run / "launcher.json"]]
        second = rlflow("train", TINY, "--run-dir", str(run), "--nproc", "2", cwd=tmp_path)
        assert second.returncode == 2, second.stderr
        assert second.stderr.startswith(
            f"error[train.run-dir-in-use]: the run directory {run} is in use: its launcher "
            f"(pid {process.pid}, attempt 0) is still running"
        )
        no_traceback(second)
        process.send_signal(signal.SIGKILL)  # no record of its end: out of memory, say
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        _stop_ranks(run)
    assert pids[0]["pid"] == process.pid
    gone = rlflow("status", str(run), cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert gone.stdout.startswith(
        f"local run run: GONE, attempt 0's launcher (pid {process.pid}, started "
    )
    assert "is gone without recording an end: it was killed" in gone.stdout
    assert "  resume:  `rlflow train tiny.yaml" in gone.stdout
    cancel = rlflow("cancel", str(run), cwd=tmp_path)
    assert cancel.stdout.startswith("local run run is not running (GONE): nothing to cancel")
    no_traceback(cancel)


def _stop_ranks(run: Path) -> None:
    """The stand-in ranks of a SIGKILLed launcher, found by their heartbeat's folder in /proc."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if f"RLFLOW_HEARTBEAT_FILE={run}/".encode() in environ:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                pass
