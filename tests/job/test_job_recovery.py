"""Hangs, bad nodes and lost nodes on the real local Slurm cluster (tests/slurm/cluster.py: 9 nodes, node9
a spare): each ends in a named root cause, and where a retry can help, in a requeue without the
offending node that resumes the run.

The payload progress.py stands in for the trainer where only the launcher's side matters; the
lost-node and preflight tests run the real `rlflow train` on the tiny CPU recipe.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm.jobs import (
    FINAL_STATES,
    PYTHON,
    RECIPES,
    REPO,
    batch_log,
    job_fields,
    payload_command,
    rlflow,
    submit,
    wait_done,
    write_recipe,
)

pytestmark = pytest.mark.usefixtures("slurm_cluster")
TINY = RECIPES / "tiny-cpu.yaml"
TRAIN_RECIPE = REPO / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
# A tiny real GRPO run: 2 ranks (one per node), a checkpoint every step.
TRAIN_OVERRIDES = (
    "warm_start.num_steps=0",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "generation.max_new_tokens=16",
    "checkpointing.save_period=1",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "preflight.allreduce_mb=4",
)


def heartbeat(run_dir: Path, rank: int, attempt: int = 0) -> dict | None:
    path = run_dir / "status" / f"attempt-{attempt}" / "heartbeat" / f"rank-{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait_for_heartbeat(run_dir: Path, job: str, rank: int, ready, timeout: float = 300) -> dict:
    """Poll rank `rank`'s progress report until `ready(report)`; the report."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beat = heartbeat(run_dir, rank)
        if beat is not None and ready(beat):
            return beat
        if job_fields(job)["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail(f"job {job} ended before rank {rank} got there:\n{batch_log(run_dir, job)}")
        time.sleep(0.05)
    pytest.fail(f"rank {rank} never got there: {heartbeat(run_dir, rank)}")


def wait_for_restart(job: str, run_dir: Path, restarts: int, timeout: float = 240) -> float:
    """Wait for the job's `restarts`-th requeue; release it at once (a requeued job otherwise
    waits ~2 minutes for its begin time). The monotonic time the requeue was seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_fields(job)
        if int(fields["Restarts"]) >= restarts and fields["JobState"] == "PENDING":
            seen = time.monotonic()
            time.sleep(3)  # slurmd refuses a start in the second of the requeue
            lifted = subprocess.run(
                ["scontrol", "update", f"JobId={job}", "StartTime=now"],
                capture_output=True,
                text=True,
            )
            # Slurm may have started it meanwhile (no begin-time hold after a node went down).
            assert lifted.returncode == 0 or "no longer pending" in lifted.stderr, (
                f"{lifted.stderr}\n{job_fields(job)}\n{batch_log(run_dir, job)}"
            )
            return seen
        if fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"):
            pytest.fail(f"job {job} ended ({fields['JobState']}):\n{batch_log(run_dir, job)}")
        time.sleep(0.5)
    pytest.fail(f"job {job} was not requeued in time:\n{batch_log(run_dir, job)}")


def wait_done_lifting_holds(job: str, run_dir: Path, timeout: float = 600) -> dict[str, str]:
    """Until the job ends, lifting the ~2-minute begin-time hold off every requeue on the way:
    after a node loss Slurm may refuse the requeued job's first step, a second (blameless)
    retry, whose hold would otherwise leave the test waiting on the clock."""
    deadline = time.monotonic() + timeout
    lifted = 0
    while True:
        fields = job_fields(job)
        if fields["JobState"] in FINAL_STATES:
            return fields
        if fields["JobState"] == "PENDING" and int(fields["Restarts"]) > lifted:
            lifted = int(fields["Restarts"])
            time.sleep(3)  # slurmd refuses a start in the second of the requeue
            subprocess.run(  # fails harmlessly when Slurm started it meanwhile
                ["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True
            )
        if time.monotonic() > deadline:
            pytest.fail(f"job {job} did not end in {timeout:.0f} s:\n{batch_log(run_dir, job)}")
        time.sleep(0.5)


def hostnames(nodelist: str) -> list[str]:
    return subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    ).stdout.split()


def attempts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]


def test_a_stopped_rank_is_named_with_its_stack_and_the_job_resumes_without_its_node(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    timeout = 10
    job, run_dir = submit(
        TINY,
        "slurm.max_failure_retries=1",
        "--nodes",
        "2",
        "--gpus",
        "1",
        cwd=tmp_path,
        command=payload_command("progress.py", str(out), "8", str(timeout), "2"),
    )
    beat = wait_for_heartbeat(run_dir, job, 1, lambda b: b["phase"] == "compute" and b["step"] >= 3)
    os.kill(beat["pid"], signal.SIGSTOP)  # inside compute(): a rank that stops making progress
    stopped = time.monotonic()
    requeued = wait_for_restart(job, run_dir, 1)
    assert requeued - stopped < timeout + 60
    fields = wait_done(job, 240, run_dir)
    log = batch_log(run_dir, job)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), log
    assert "node2" not in hostnames(fields["NodeList"])
    # No step lost or run twice: the second attempt resumed after the last finished step.
    assert (out / "steps.txt").read_text().split() == [str(s) for s in range(1, 9)]
    stacks = run_dir / "logs" / "hang-attempt0-node1.txt"
    hang = stacks.read_text()
    silent = re.search(r"rank 1 \(node2\) made no progress for (\d+) s", hang.splitlines()[0])
    assert silent and timeout <= int(silent[1]) <= timeout + 2, hang.splitlines()[0]
    assert "process state T" in hang  # SIGSTOPped, and still dumped (SIGCONT after SIGUSR2)
    # Dumped when it continues (SIGCONT after SIGUSR2): usually inside compute(), sometimes the
    # next line of main() when its sleep expired while stopped (test_launch_watchdog.py).
    assert 'progress.py", line' in hang and " in main\n" in hang
    status = rlflow("status", job, cwd=tmp_path).stdout
    assert f"failure: attempt-0: rank 1 (node2) made no progress for {silent[1]} s" in status
    assert "in phase `compute` at step" in status and f"stacks: {stacks}" in status
    assert "0: node-failure on node[1-2] at step" in status
    assert ", excluding node2 next -> requeue without node2 (retry 1 of" in status
    assert f"1: completed on {fields['NodeList']} at step 8" in status
    assert "requeueing without nodes node2" in log


def test_preflight_names_a_node_with_too_few_gpus_and_the_job_finishes_without_it(tmp_path):
    """node2's driver shows no GPU where the job asked for one (faked: the test cluster's GPUs
    are device files and torch is a CPU build, see rlflow/job/preflight.py). The payload is
    the trainer's start-up up to its preflight (the lost-node test runs the whole trainer)."""
    job, run_dir = submit(
        TINY,
        "slurm.env.RLFLOW_TEST_VISIBLE_GPUS=node2:0",
        "preflight.allreduce_mb=4",
        "--nodes",
        "2",
        "--gpus",
        "1",
        cwd=tmp_path,
        command=payload_command("preflight.py"),
    )
    wait_for_restart(job, run_dir, 1)
    fields = wait_done(job, 240, run_dir)
    log = batch_log(run_dir, job)
    assert fields["JobState"] == "COMPLETED" and "node2" not in hostnames(fields["NodeList"]), log
    first = attempts(run_dir)[0]
    assert (first["outcome"], first["bad_nodes"], first["exit_code"]) == (
        "node-failure",
        ["node2"],
        78,
    )
    assert "failed preflight: gpus: 0 GPUs visible, 1 requested" in first["reason"]
    status = rlflow("status", job, cwd=tmp_path).stdout
    assert "rank 1 on node2 (node 1) failed preflight: gpus: 0 GPUs visible, 1 requested" in status
    rank0 = (run_dir / "logs" / "rank-0.log").read_text()
    assert "preflight: 2 nodes passed (gpus, disk, env)" in rank0  # attempt 1, without node2
    assert "all-reduce of 4 MiB over 2 ranks" in rank0


def test_when_retries_run_out_the_final_status_says_so(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job, run_dir = submit(
        TINY,
        "slurm.max_failure_retries=0",
        "--nodes",
        "2",
        "--gpus",
        "1",
        cwd=tmp_path,
        command=payload_command("progress.py", str(out), "100", "5", "1"),
    )
    beat = wait_for_heartbeat(run_dir, job, 0, lambda b: b["step"] >= 2)
    os.kill(beat["pid"], signal.SIGSTOP)
    fields = wait_done(job, 120, run_dir)
    log = batch_log(run_dir, job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "77:0", "0")
    assert "stop: node-failure retries exhausted (slurm.max_failure_retries=0)" in log
    status = rlflow("status", job, cwd=tmp_path).stdout
    assert (
        "final: stopped after 1 attempt with exit code 77: node-failure retries exhausted "
        "(slurm.max_failure_retries=0)"
    ) in status


def test_a_recipe_error_is_never_retried(tmp_path):
    bad = write_recipe(tmp_path / "bad.yaml", {"grpo": {"max_num_step": 3}}, defaults=TRAIN_RECIPE)
    job, run_dir = submit(
        TINY,
        "slurm.max_failure_retries=3",
        "--nodes",
        "2",
        "--gpus",
        "1",
        cwd=tmp_path,
        command=f"{PYTHON} -m rlflow.cli train {bad}",
    )
    fields = wait_done(job, 120, run_dir)
    log = batch_log(run_dir, job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "2:0", "0")
    assert "not retried (a retry would fail the same way)" in log
    assert [a["outcome"] for a in attempts(run_dir)] == ["failed"]


def _slurmd_pid(cluster, node: str) -> int:
    for line in (cluster.state / "pids").read_text().splitlines():
        name, pid, _ = line.split()
        if name == f"slurmd-{node}":
            return int(pid)
    raise AssertionError(f"no slurmd-{node} in {cluster.state / 'pids'}")


def _restart_slurmd(cluster, node: str) -> None:
    """The node comes back (a reboot): a fresh slurmd, recorded where stop.sh finds it."""
    daemon = subprocess.Popen(
        ["/usr/sbin/slurmd", "-D", "-N", node, "-f", str(cluster.conf)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pids = cluster.state / "pids"
    lines = [
        line
        if not line.startswith(f"slurmd-{node} ")
        else f"slurmd-{node} {daemon.pid} {os.path.realpath('/usr/sbin/slurmd')}"
        for line in pids.read_text().splitlines()
    ]
    pids.write_text("\n".join(lines) + "\n")


def _resume(cluster, node: str) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = subprocess.run(
            ["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True, text=True
        ).stdout.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    raise AssertionError(f"{node} did not come back: {state}")


def _restart_controller(cluster) -> None:
    """A fresh slurmctld (same state directory), as an admin would after a node loss.

    Slurm 22.05 leaks GPU gres counts when a job whose step it refused on a lost node is
    requeued ("_step_get_gres_cnt ... node offset invalid", then "dealloc ... bad node_offset"):
    the nodes keep GresUsed=gpu:1 after the job ends, and a later job asking for every GPU of
    those nodes pends forever. A controller restart recounts gres from the live jobs.
    """
    pids = cluster.state / "pids"
    lines = pids.read_text().splitlines()
    old = next(int(line.split()[1]) for line in lines if line.startswith("slurmctld "))
    os.kill(old, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _alive(old):
        assert time.monotonic() < deadline, "slurmctld did not stop"
        time.sleep(0.2)
    log = (cluster.state / "log" / "slurmctld.out").open("ab")
    daemon = subprocess.Popen(
        ["/usr/sbin/slurmctld", "-D", "-f", str(cluster.conf)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    pids.write_text(
        "\n".join(
            f"slurmctld {daemon.pid} {os.path.realpath('/usr/sbin/slurmctld')}"
            if line.startswith("slurmctld ")
            else line
            for line in lines
        )
        + "\n"
    )
    deadline = time.monotonic() + 60
    while True:
        nodes = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True
        ).stdout.split("\n")
        if (
            nodes
            and all(line.endswith(" idle") for line in nodes if line.strip())
            and any(line.strip() for line in nodes)
        ):
            return
        assert time.monotonic() < deadline, f"nodes not idle after a controller restart: {nodes}"
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_lost_node_is_excluded_and_the_run_resumes_without_lost_or_repeated_steps(
    tmp_path, slurm_cluster
):
    """Also the default rank command (no --command): `<slurm.rlflow_command> train
    RUN_DIR/recipe.yaml --run-dir RUN_DIR`, the real trainer, submitted from the repository
    (where `uv run` finds the project, and the pin check runs on it). That a resumed run's
    metrics equal an uninterrupted run's is the checkpoint's promise, tested in
    tests/train/test_train_runs.py."""
    steps = 4
    job, run_dir = submit(
        TRAIN_RECIPE,
        f"run.output_dir={tmp_path}",
        *TRAIN_OVERRIDES,
        f"grpo.max_num_steps={steps}",
        "--nodes",
        "2",
        "--gpus",
        "1",
        cwd=REPO,
    )
    beat = wait_for_heartbeat(run_dir, job, 1, lambda b: b["step"] >= 2, timeout=600)
    # node2 dies: its slurmd, the step daemon and the node launcher are SIGKILLed at once.
    launcher = int((run_dir / "status" / "attempt-0" / "node-1.started").read_text().split()[2])
    stepd = int(Path(f"/proc/{launcher}/stat").read_text().rsplit(")", 1)[1].split()[1])
    for pid in (_slurmd_pid(slurm_cluster, "node2"), stepd, launcher):
        os.kill(pid, signal.SIGKILL)
    lost_at = time.monotonic()
    # No orphans: the rank dies with its launcher (proctrack/linuxproc cannot see it any more).
    while _alive(beat["pid"]):
        assert time.monotonic() - lost_at < 5, "rank 1 outlived its killed launcher"
        time.sleep(0.1)
    deadline = time.monotonic() + 120
    while "requeueing without nodes node2" not in batch_log(run_dir, job):
        assert time.monotonic() < deadline, batch_log(run_dir, job)
        time.sleep(0.5)
    # What Slurm does by itself once node2 misses SlurmdTimeout (minutes here): mark it down,
    # which completes the requeued job's cleanup there. Then node2 comes back.
    subprocess.run(
        ["scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=lost in a test"],
        check=True,
    )
    _restart_slurmd(slurm_cluster, "node2")
    try:
        fields = wait_done_lifting_holds(job, run_dir)
    finally:
        _resume(slurm_cluster, "node2")  # the later tests expect node1-8
        _restart_controller(slurm_cluster)
    log = batch_log(run_dir, job)
    assert f"train {run_dir}/recipe.yaml --run-dir {run_dir}" in log
    assert json.loads((run_dir / "git.json").read_text())["repository"] == str(REPO)
    # Slurm may refuse the first step after the requeue (node2 still being cleaned up): that is
    # a second, blameless retry (attempts.py), never a failure of the run.
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, log
    assert "node2" not in hostnames(fields["NodeList"])
    lost = attempts(run_dir)[0]
    assert (lost["outcome"], lost["bad_nodes"], lost["excluded"]) == (
        "node-failure",
        ["node2"],
        ["node2"],
    )
    assert "node node2 lost: its launcher never reported an exit" in lost["reason"]
    status = rlflow("status", job, cwd=tmp_path).stdout
    assert "node node2 lost" in status and "-> requeue without node2" in status
    rank0 = (run_dir / "logs" / "rank-0.log").read_text()
    assert "resumed from" in rank0
    assert rank0.count("preflight: 2 nodes passed (gpus, disk, env)") == 2  # each attempt
    saved = attempts(run_dir)[0]["checkpoint_step"]
    assert f"(step {saved})" in rank0.split("resumed from", 1)[1].splitlines()[0]
    got = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # none lost, none repeated
