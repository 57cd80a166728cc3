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

from tests.slurm.cluster import alive, daemon_pid, restart_controller, restart_slurmd, restore
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
    wait_for_files,
    write_recipe,
)

pytestmark = pytest.mark.usefixtures("slurm_cluster")
TINY = RECIPES / "tiny-cpu.yaml"
TRAIN_RECIPE = REPO / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
# A tiny real GRPO run: 2 ranks (one per node), a checkpoint every step, the smallest steps
# (one prompt per rank, 4-token answers): only the steps' count and order are looked at.
TRAIN_OVERRIDES = (
    "warm_start.num_steps=0",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.num_minibatches=1",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "generation.max_new_tokens=4",
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


def launcher_of_node(run_dir: Path, node_rank: int) -> tuple[int, int]:
    """(node launcher pid, its slurmstepd's pid) of node rank `node_rank` in attempt 0."""
    started = run_dir / "status" / "attempt-0" / f"node-{node_rank}.started"
    launcher = int(started.read_text().split()[2])
    stepd = int(Path(f"/proc/{launcher}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return launcher, stepd


def wait_for_log(run_dir: Path, job: str, text: str, timeout: float = 120) -> None:
    """Until the batch log says `text`; the timeout is a hang guard."""
    deadline = time.monotonic() + timeout
    while text not in batch_log(run_dir, job):
        assert time.monotonic() < deadline, f"never logged {text!r}:\n{batch_log(run_dir, job)}"
        time.sleep(0.5)


def test_a_frozen_node_is_excluded_when_the_other_nodes_save_and_stop(tmp_path, slurm_cluster):
    """node2 freezes (its slurmd, step daemon and launcher SIGSTOPped: a hung kernel, a stalled
    disk), and node1's ranks then save and stop for the time limit (exit 75), so no rank failure
    is ever recorded and srun would wait for node2 until Slurm declared it down. The batch
    script sees node2's launcher stop bumping node-1.alive, ends the step and requeues without
    node2. (CI once lost this race in the lost-node test below: the dying rank's stop request
    reached rank 0, which saved and stopped cleanly.)"""
    out = tmp_path / "out"
    out.mkdir()
    job, run_dir = submit(
        TINY,
        "slurm.max_failure_retries=1",
        "--nodes",
        "2",
        "--gpus",
        "1",
        cwd=tmp_path,
        command=payload_command("requeue.py", str(out)),
    )
    wait_for_files([out / "rank-0.ready", out / "rank-1.ready"], job, run_dir)
    launcher, stepd = launcher_of_node(run_dir, 1)
    frozen = [daemon_pid(slurm_cluster, "slurmd-node2"), stepd, launcher]
    try:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        node0, _ = launcher_of_node(run_dir, 0)
        os.kill(node0, signal.SIGUSR1)  # the time-limit warning, as node1's launcher hears it
        wait_for_log(run_dir, job, "ranks 0 saved and stopped for a requeue (exit 75)")
        wait_for_log(run_dir, job, "the launcher of node-1 has shown no sign of life for 15 s")
        wait_for_log(run_dir, job, "requeueing without nodes node2")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)  # node2 thaws: Slurm can finish the old attempt there
    fields = wait_done_lifting_holds(job, run_dir, timeout=240)
    log = batch_log(run_dir, job)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), log
    assert "node2" not in hostnames(fields["NodeList"])
    lost = attempts(run_dir)[0]
    assert (lost["outcome"], lost["bad_nodes"], lost["excluded"]) == (
        "node-failure",
        ["node2"],
        ["node2"],
    )
    assert "node node2 lost: its launcher never reported an exit" in lost["reason"]
    assert (out / "rank-0.txt").read_text().splitlines() == [
        "attempt 0: warned, saved",
        "attempt 1: resumed after 'attempt 0: warned, saved'",
    ]


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
    launcher, stepd = launcher_of_node(run_dir, 1)
    try:
        for pid in (daemon_pid(slurm_cluster, "slurmd-node2"), stepd, launcher):
            os.kill(pid, signal.SIGKILL)
        lost_at = time.monotonic()
        # No orphans: the rank dies with its launcher (proctrack/linuxproc cannot see it any more).
        while alive(beat["pid"]):
            assert time.monotonic() - lost_at < 5, "rank 1 outlived its killed launcher"
            time.sleep(0.1)
        # Rank 0 then either fails on its dead peer (exit 76), or, when rank 1 heard the
        # reaper's SIGTERM just before a step boundary, saves and stops with it (exit 75). Either
        # way node2's launcher stopped bumping node-1.alive: the step ends, node2 is excluded.
        wait_for_log(run_dir, job, "requeueing without nodes node2")
        # What Slurm does by itself once node2 misses SlurmdTimeout (minutes here): mark it
        # down, which completes the requeued job's cleanup there. Then node2 comes back.
        subprocess.run(
            ["scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=lost in a test"],
            check=True,
        )
        restart_slurmd(slurm_cluster, "node2")
        fields = wait_done_lifting_holds(job, run_dir)
    finally:
        # Slurm 22.05 leaks GPU counts when a job whose step it refused on a lost node is
        # requeued: the nodes keep GPUs counted in use after the job ends, and a later job
        # asking for every GPU there pends forever. A new controller recounts them.
        restart_controller(slurm_cluster)
        restore(slurm_cluster)  # node2 back (resumed, idle)
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
