"""Watchdog, recovery and preflight timings on the local Slurm cluster (tests/slurm).

1. hang -> job end: 2 nodes x 1 rank of tests/launch/payloads/progress.py (phase timeout T);
   rank 1 SIGSTOPped inside a step. Measured: SIGSTOP -> the timeout passing -> job final.
2. node loss -> resumed first step: the same payload; node2's slurmd, step daemon and launcher
   SIGKILLed mid-run. Measured: kill -> requeue decided (rlflow's part) -> the job running again
   without node2 -> first step of the new attempt. Two Slurm waits are lifted as in the tests
   (`scontrol update StartTime=now` for the requeue's begin time; node2 marked DOWN instead of
   waiting SlurmdTimeout): both are reported apart, with their production values.
3. preflight cost per job start: `rlflow train --nproc 2` on the tiny CPU recipe, the trainer's
   own log line (checks + all-reduce), for preflight.allreduce_mb 64 (default) and 4.

Usage: uv run python benchmarks/watchdog.py [--repeats 3] > benchmarks/results/watchdog.json
Starts its own 3-node cluster in /tmp and stops it at the end (root, Debian 12, as the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "tests" / "slurm"
PAYLOAD = REPO / "tests" / "launch" / "payloads" / "progress.py"
TINY = REPO / "tests" / "launch" / "recipes" / "tiny-cpu.yaml"
PY = sys.executable


def sh(*args: str, **kw) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True, **kw).stdout


def fields(job: str) -> dict[str, str]:
    out = sh("scontrol", "show", "job", "-o", job)
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def submit(workdir: Path, *args: str, command: str) -> tuple[str, Path]:
    out = sh(PY, "-m", "rlflow.cli", "submit", str(TINY), *args, "--command", command, cwd=workdir)
    job = re.search(r"submitted job (\d+)", out)[1]
    return job, Path(re.search(r"run dir: (.*)", out)[1].strip())


def beat(run_dir: Path, rank: int, attempt: int = 0) -> dict | None:
    path = run_dir / "status" / f"attempt-{attempt}" / "heartbeat" / f"rank-{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"timed out: {what}")


def hang_case(workdir: Path, timeout_s: int) -> dict:
    out = Path(tempfile.mkdtemp(dir=workdir))
    job, run_dir = submit(
        workdir,
        "slurm.max_failure_retries=0",
        "--nodes",
        "2",
        "--gpus",
        "1",
        command=f"{PY} {PAYLOAD} {out} 1000 {timeout_s} 1",
    )
    b = wait(
        lambda: (x := beat(run_dir, 1)) and x["phase"] == "compute" and x["step"] >= 3 and x,
        300,
        "rank 1 at step 3",
    )
    os.kill(b["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    last_report = time.monotonic() - (time.clock_gettime(time.CLOCK_MONOTONIC) - b["time"])
    wait(lambda: fields(job)["JobState"] in ("FAILED", "COMPLETED"), 300, "job end")
    ended = time.monotonic()
    return {
        "phase_timeout_s": timeout_s,
        "stop_to_job_end_s": round(ended - stopped, 1),
        "timeout_passed_to_job_end_s": round(ended - (last_report + timeout_s), 1),
        "exit_code": fields(job)["ExitCode"],
    }


def lost_node_case(workdir: Path, state: Path) -> dict:
    out = Path(tempfile.mkdtemp(dir=workdir))
    job, run_dir = submit(
        workdir, "--nodes", "2", "--gpus", "1", command=f"{PY} {PAYLOAD} {out} 60 60 1"
    )
    wait(lambda: (x := beat(run_dir, 1)) and x["step"] >= 3, 300, "rank 1 at step 3")
    launcher = int((run_dir / "status/attempt-0/node-1.started").read_text().split()[2])
    stepd = int(Path(f"/proc/{launcher}/stat").read_text().rsplit(")", 1)[1].split()[1])
    slurmd = next(
        int(line.split()[1])
        for line in (state / "pids").read_text().splitlines()
        if line.startswith("slurmd-node2 ")
    )
    for pid in (slurmd, stepd, launcher):
        os.kill(pid, signal.SIGKILL)
    lost = time.monotonic()
    log = run_dir / "logs" / f"slurm-{job}.out"
    wait(lambda: "requeueing without nodes node2" in log.read_text(), 300, "requeue")
    decided = time.monotonic()
    sh("scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=benchmark")
    daemon = subprocess.Popen(
        ["/usr/sbin/slurmd", "-D", "-N", "node2", "-f", str(state / "etc" / "slurm.conf")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    attempts = out / "attempts.txt"
    pending = running = first_step = None
    lifted: set[str] = set()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        f = fields(job)
        if f["JobState"] == "PENDING" and f["Restarts"] not in lifted:
            pending = pending or time.monotonic()
            time.sleep(3)  # slurmd refuses a start in the second of the requeue
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False)
            lifted.add(f["Restarts"])
        if f["JobState"] == "RUNNING" and pending and not running:
            running = time.monotonic()
        lines = attempts.read_text().splitlines() if attempts.exists() else []
        if first_step is None and any(not line.startswith("0 ") for line in lines):
            first_step = time.monotonic()
        if f["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.1)
    restarts = fields(job)["Restarts"]
    subprocess.run(["scontrol", "update", "NodeName=node2", "State=RESUME"], check=False)
    pids = (state / "pids").read_text().splitlines()
    exe = os.path.realpath("/usr/sbin/slurmd")
    fixed = [
        f"slurmd-node2 {daemon.pid} {exe}" if p.startswith("slurmd-node2 ") else p for p in pids
    ]
    (state / "pids").write_text("\n".join(fixed) + "\n")
    return {
        "final_state": fields(job)["JobState"],
        "restarts": int(restarts),
        "loss_to_requeue_decided_s": round(decided - lost, 1),
        "requeue_to_pending_s (node2 marked DOWN by hand)": round(pending - decided, 1),
        "pending_to_running_s (begin time lifted, +3 s wait)": round(running - pending, 1),
        "running_to_first_resumed_step_s": round(first_step - running, 1),
        "loss_to_first_resumed_step_s": round(first_step - lost, 1),
    }


def preflight_case(allreduce_mb: int) -> dict:
    run_dir = Path(tempfile.mkdtemp())
    recipe = REPO / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
    sh(
        PY,
        "-m",
        "rlflow.cli",
        "train",
        str(recipe),
        "warm_start.num_steps=0",
        "grpo.max_num_steps=1",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "logging.progress_bar=false",
        f"preflight.allreduce_mb={allreduce_mb}",
        "--nproc",
        "2",
        "--run-dir",
        str(run_dir),
        cwd=REPO,
    )
    line = next(
        ln
        for ln in (run_dir / "logs" / "rank-0.log").read_text().splitlines()
        if "preflight:" in ln
    )
    total = float(re.search(r"preflight took ([\d.]+) s", line)[1])
    return {"allreduce_mb": allreduce_mb, "preflight_s": total, "log": line}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="rlflow-bench-slurm-", dir="/tmp"))
    state.chmod(0o755)
    env = {
        **os.environ,
        "SLURM_LOCAL_NODES": "3",
        "SLURM_LOCAL_GPUS": "4",
        "SLURM_LOCAL_LINK_ETC": "0",
        "SLURM_LOCAL_CTLD_PORT": "28100",
        "SLURM_LOCAL_DBD_PORT": "28101",
        "SLURM_LOCAL_DB_PORT": "28102",
        "SLURM_LOCAL_SLURMD_PORT_BASE": "28110",
    }
    subprocess.run(
        ["bash", str(HARNESS / "start.sh"), str(state)], env=env, check=True, capture_output=True
    )
    os.environ["SLURM_CONF"] = str(state / "etc" / "slurm.conf")
    results: dict = {"cpu_cores": os.cpu_count()}
    try:
        with tempfile.TemporaryDirectory() as work:
            workdir = Path(work)
            results["hang"] = [hang_case(workdir, 30) for _ in range(args.repeats)]
            results["lost_node"] = [lost_node_case(workdir, state) for _ in range(args.repeats)]
        results["preflight"] = [preflight_case(mb) for mb in (64, 4)]
    finally:
        subprocess.run(
            ["bash", str(HARNESS / "stop.sh"), "--purge", str(state)], capture_output=True
        )
    for key in ("hang", "lost_node"):
        for name in results[key][0]:
            values = [r[name] for r in results[key] if isinstance(r[name], float)]
            if values:
                results.setdefault(f"{key}_median", {})[name] = statistics.median(values)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
