"""`rlflow submit`, `status`, `logs` and `cancel` against the real local Slurm cluster.

Every job here is a real sbatch job on 8 slurmd nodes with fake GPUs (conftest.py); the
payloads in payloads/ stand in for the trainer. Jobs run in the test's tmp_path (their
working directory, where their run directories go).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm.jobs import (
    PYTHON,
    RECIPES,
    batch_log,
    job_fields,
    payload_command,
    rlflow,
    submit,
    wait_done,
    wait_for_files,
    wait_for_state,
    write_recipe,
)

pytestmark = pytest.mark.usefixtures("slurm_cluster")
TINY = RECIPES / "tiny-cpu.yaml"


def test_allreduce_over_8_nodes_x_4_gpus(tmp_path):
    out = tmp_path / "allreduce"
    out.mkdir()
    job, run_dir = submit(
        TINY,
        "--nodes",
        "8",
        "--gpus",
        "4",
        cwd=tmp_path,
        command=payload_command("allreduce.py", str(out)),
    )
    fields = wait_done(job, timeout=800, run_dir=run_dir)  # 32 torch imports on 2 cores
    assert fields["JobState"] == "COMPLETED", batch_log(run_dir, job)
    records = [json.loads(p.read_text()) for p in out.glob("rank-*.json")]
    assert sorted(r["rank"] for r in records) == list(range(32))
    assert {(r["sum"], r["expected"], r["world_size"]) for r in records} == {(528.0, 528.0, 32)}
    nodes: dict[str, set[str]] = {}
    for r in records:
        env = r["env"]
        assert int(env["NODE_RANK"]) * 4 + int(env["LOCAL_RANK"]) == r["rank"]
        assert (env["LOCAL_WORLD_SIZE"], env["SLURM_JOB_ID"]) == ("4", job)
        nodes.setdefault(env["SLURMD_NODENAME"], set()).add(env["LOCAL_RANK"])
    assert nodes == {f"node{i}": {"0", "1", "2", "3"} for i in range(1, 9)}
    rank0 = next(r for r in records if r["rank"] == 0)["env"]
    # Rendezvous at the first node's NodeAddr, on a port below 9000 derived from the job id.
    assert rank0["SLURMD_NODENAME"] == "node1"
    assert {(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in records} == {
        ("127.0.0.1", str(1400 + int(job) % 600))
    }
    # --nodes/--gpus filled the allocation and the recipe alike.
    assert fields["NumNodes"] == "8" and "gres/gpu=32" in fields["TRES"]
    assert "cluster:\n  num_nodes: 8\n  gpus_per_node: 4\n" in (run_dir / "recipe.yaml").read_text()
    assert json.loads((run_dir / "git.json").read_text())["repository"] is None


def test_cpu_only_request_starts_ranks_per_node_without_gpus(tmp_path):
    job, run_dir = submit(
        TINY,
        "slurm.request_gpus=false",
        "--nodes",
        "2",
        "--gpus",
        "3",
        cwd=tmp_path,
        command="bash -c 'echo rank $RANK of $WORLD_SIZE'",
    )
    fields = wait_done(job, 120, run_dir)
    assert fields["JobState"] == "COMPLETED", batch_log(run_dir, job)
    assert "gres/gpu" not in fields["TRES"]
    for rank in range(6):
        assert (run_dir / "logs" / f"rank-{rank}.log").read_text().splitlines()[
            1
        ] == f"rank {rank} of 6"


def test_one_failing_rank_fails_the_job_at_once(tmp_path):
    command = (
        'bash -c \'if [ "$RANK" = 5 ]; then echo "rank 5 gives up" >&2; exit 7; fi; '
        "exec sleep 900'"
    )
    job, run_dir = submit(
        TINY, "--nodes", "4", "--gpus", "2", "--time", "00:15:00", cwd=tmp_path, command=command
    )
    # The other 7 ranks sleep past the 15-minute limit: only failure propagation ends it sooner.
    fields = wait_done(job, timeout=120, run_dir=run_dir)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "7:0")
    log = batch_log(run_dir, job)
    assert "rank 5 exited with code 7; stopping ranks 4" in log
    assert "rlflow: failed: rank 5 on node3 (node 2) exited with code 7" in log
    status = rlflow("status", job, cwd=tmp_path)
    assert "FAILED" in status.stdout
    assert "failure: attempt-0: rank 5 on node3 (node 2) exited with code 7" in status.stdout
    assert "rank 5 gives up" in (run_dir / "logs" / "rank-5.log").read_text()


def _wait_for_requeue(job: str, run_dir: Path) -> None:
    """Attempt 0 ended with a requeue. Slurm holds a requeued job back for ~2 minutes (its
    BeginTime); move that to now so the test does not sit idle. Not at once: slurmd refuses a
    start in the same second as the requeue ("Job credential revoked"), which is what Slurm's
    hold-back protects against."""
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        fields = job_fields(job)
        if fields["Restarts"] == "1" and fields["JobState"] == "PENDING":
            time.sleep(3)
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
            return
        if fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"):
            pytest.fail(
                f"job {job} ended ({fields['JobState']}) instead of requeueing:\n"
                + batch_log(run_dir, job)
            )
        time.sleep(0.5)
    pytest.fail(f"job {job} was not requeued in time:\n" + batch_log(run_dir, job))


def test_requeue_after_the_time_limit_warning(tmp_path):
    out = tmp_path / "records"
    out.mkdir()
    # 1-minute limit, warning 50 s before it: Slurm delivers it within ~10-40 s.
    job, run_dir = submit(
        TINY,
        "slurm.signal_grace_seconds=50",
        "slurm.max_requeues=1",
        "--time",
        "1",
        "--nodes",
        "2",
        "--gpus",
        "2",
        cwd=tmp_path,
        command=payload_command("requeue.py", str(out)),
    )
    _wait_for_requeue(job, run_dir)
    fields = wait_done(job, timeout=120, run_dir=run_dir)
    log = batch_log(run_dir, job)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), log
    for rank in range(4):
        assert (out / f"rank-{rank}.txt").read_text() == (
            "attempt 0: warned, saved\nattempt 1: resumed after 'attempt 0: warned, saved'\n"
        )
    assert "time-limit warning (SIGUSR1): asking the ranks to save and stop" in log
    assert "requeueing: attempt 1 continues the run" in log
    assert "rlflow: job " + job + " attempt 1 on" in log
    stopped = sorted(p.name for p in (run_dir / "status" / "attempt-0").glob("stopped-*"))
    assert stopped == ["stopped-node-0", "stopped-node-1"]


def test_no_requeue_left_ends_the_job_with_75(tmp_path):
    """The warning is sent the way Slurm's --signal=B:USR1 sends it (to the batch shell), as
    soon as the ranks listen: test_requeue_after_the_time_limit_warning waits for Slurm's own."""
    out = tmp_path / "records"
    out.mkdir()
    job, run_dir = submit(
        TINY,
        "slurm.max_requeues=0",
        "slurm.max_failure_retries=0",
        "--nodes",
        "1",
        "--gpus",
        "2",
        cwd=tmp_path,
        command=payload_command("requeue.py", str(out)),
    )
    wait_for_files([out / "rank-0.ready", out / "rank-1.ready"], job, run_dir)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    fields = wait_done(job, timeout=150, run_dir=run_dir)
    log = batch_log(run_dir, job)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == (
        "FAILED",
        "75:0",
        "0",
    ), log
    assert "no requeues are left (slurm.max_requeues=0)" in log
    assert "#SBATCH --no-requeue" in (run_dir / "script.sbatch").read_text()


def test_after_runs_the_second_job_once_the_first_succeeded(tmp_path):
    first, first_dir = submit(
        TINY,
        "--nodes",
        "1",
        "--gpus",
        "1",
        cwd=tmp_path,
        command="bash -c 'sleep 4; touch first-done'",
    )
    second, second_dir = submit(
        TINY,
        "--nodes",
        "1",
        "--gpus",
        "1",
        "--after",
        first,
        cwd=tmp_path,
        command="bash -c 'test -e first-done && touch second-saw-first'",
    )
    assert job_fields(second)["Dependency"] == f"afterok:{first}(unfulfilled)"
    assert job_fields(second)["JobState"] == "PENDING"
    assert wait_done(first, 120, first_dir)["JobState"] == "COMPLETED"
    done = wait_done(second, 120, second_dir)
    assert done["JobState"] == "COMPLETED", batch_log(second_dir, second)
    assert (tmp_path / "second-saw-first").exists()
    assert done["StartTime"] >= job_fields(first)["EndTime"]


def test_after_a_failure_afterok_never_starts_and_afterany_does(tmp_path):
    failing, failing_dir = submit(
        TINY, "--nodes", "1", "--gpus", "1", cwd=tmp_path, command="bash -c 'sleep 2; exit 3'"
    )
    blocked, _ = submit(
        TINY,
        "--nodes",
        "1",
        "--gpus",
        "1",
        "--after",
        failing,
        cwd=tmp_path,
        command="touch blocked-ran",
    )
    anyway, anyway_dir = submit(
        TINY,
        "--nodes",
        "1",
        "--gpus",
        "1",
        "--after",
        failing,
        "--dependency-type",
        "afterany",
        cwd=tmp_path,
        command="touch anyway-ran",
    )
    assert job_fields(anyway)["Dependency"] == f"afterany:{failing}(unfulfilled)"
    assert wait_done(failing, 120, failing_dir)["JobState"] == "FAILED"
    assert wait_done(anyway, 120, anyway_dir)["JobState"] == "COMPLETED"
    fields = wait_for_state(blocked, {"PENDING"}, 10)
    for _ in range(20):
        if fields["Reason"] == "DependencyNeverSatisfied":
            break
        time.sleep(0.5)
        fields = job_fields(blocked)
    assert fields["Reason"] == "DependencyNeverSatisfied"
    cancelled = rlflow("cancel", blocked, cwd=tmp_path)
    assert (
        cancelled.returncode == 0 and f"cancelled job {blocked} (was PENDING)" in cancelled.stdout
    )
    assert wait_done(blocked, 60)["JobState"] == "CANCELLED"
    assert (tmp_path / "anyway-ran").exists() and not (tmp_path / "blocked-ran").exists()


def test_status_logs_and_cancel(tmp_path):
    command = "bash -c 'echo step 1; echo step 2; echo \"rank $RANK ready\"; exec sleep 900'"
    job, run_dir = submit(TINY, "--nodes", "2", "--gpus", "1", cwd=tmp_path, command=command)
    wait_for_state(job, {"RUNNING"}, 120, run_dir)
    rank0 = run_dir / "logs" / "rank-0.log"
    for _ in range(120):
        if rank0.exists() and "rank 0 ready" in rank0.read_text():
            break
        time.sleep(0.5)
    for ref in (job, str(run_dir)):
        status = rlflow("status", ref, cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        assert re.search(
            rf"job {job} \(tiny-cpu\): RUNNING, .* of 00:10:00, nodes node\[1-2\]", status.stdout
        )
        assert f"run dir: {run_dir}" in status.stdout
    logs = rlflow("logs", job, cwd=tmp_path)
    assert logs.stdout.splitlines()[1:] == ["step 1", "step 2", "rank 0 ready"]
    assert "rank 1 ready" in rlflow("logs", str(run_dir), "--rank", "1", cwd=tmp_path).stdout
    assert (
        f"rlflow: job {job} attempt 0 on node[1-2]"
        in rlflow("logs", job, "--batch", cwd=tmp_path).stdout
    )
    cancelled = rlflow("cancel", job, cwd=tmp_path)
    assert cancelled.stdout.strip() == f"cancelled job {job} (was RUNNING)"
    assert wait_done(job, 60, run_dir)["JobState"] == "CANCELLED"
    assert "CANCELLED" in rlflow("status", job, cwd=tmp_path).stdout
    again = rlflow("cancel", str(run_dir), cwd=tmp_path)
    assert again.stdout.strip() == f"job {job} has already ended (CANCELLED): nothing to cancel"


def test_logs_follow_prints_until_the_job_ends(tmp_path):
    command = "bash -c 'for i in 1 2 3 4 5; do echo line $i; sleep 1; done'"
    job, run_dir = submit(TINY, "--nodes", "1", "--gpus", "1", cwd=tmp_path, command=command)
    followed = rlflow("logs", job, "--follow", cwd=tmp_path, timeout=180)
    assert followed.returncode == 0, followed.stderr
    assert [line for line in followed.stdout.splitlines() if line.startswith("line")] == [
        f"line {i}" for i in range(1, 6)
    ]
    assert f"job {job} ended: COMPLETED" in followed.stderr
    failing, _ = submit(
        TINY, "--nodes", "1", "--gpus", "1", cwd=tmp_path, command="bash -c 'exit 4'"
    )
    assert rlflow("logs", failing, "--follow", cwd=tmp_path, timeout=180).returncode == 1


def test_unknown_job(tmp_path):
    status = rlflow("status", "999999", cwd=tmp_path)
    assert status.returncode == 1
    assert "error[jobs.not-found]: Slurm knows no job 999999" in status.stderr
    logs = rlflow("logs", str(tmp_path), cwd=tmp_path)
    assert logs.returncode == 2 and "is neither a job id nor a run directory" in logs.stderr


HOSTILE = 'x"; touch /tmp/pwned; "'


def test_hostile_values_are_data_on_the_real_cluster(tmp_path):
    """Job name, env value, setup command and output directory from the issue's injection list
    go through sbatch, bash and srun for real; none of them runs."""
    canary = Path("/tmp/pwned")
    canary.unlink(missing_ok=True)
    recipe = write_recipe(
        tmp_path / "hostile.yaml",
        {
            "run": {"name": HOSTILE, "output_dir": 'it\'s a "dir"; $(id) & more'},
            "slurm": {
                "env": {"HOSTILE": HOSTILE, "SUBST": "$(id)"},
                "setup_command": "echo x\"; touch /tmp/pwned; \" '$(id)'",
            },
        },
    )
    command = (
        f"{PYTHON} -c \"import os; print(repr(os.environ['HOSTILE']), repr(os.environ['SUBST']))\""
    )
    job, run_dir = submit(recipe, "--nodes", "2", "--gpus", "1", cwd=tmp_path, command=command)
    fields = wait_done(job, 120, run_dir)
    log = batch_log(run_dir, job)
    assert fields["JobState"] == "COMPLETED", log
    assert not canary.exists()
    assert run_dir.parent == tmp_path / 'it\'s a "dir"; $(id) & more'
    name = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", job, "-o", "%j"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.rstrip("\n")
    assert name == HOSTILE
    assert (run_dir / "logs" / "rank-0.log").read_text().splitlines()[1] == f"{HOSTILE!r} '$(id)'"
    # The setup command ran once per node as written: its quotes are its own, none were added.
    assert log.splitlines().count("x; touch /tmp/pwned;  $(id)") == 2, log


def test_sbatch_refusal_leaves_no_run_directory(tmp_path):
    result = rlflow(
        "submit",
        str(TINY),
        "slurm.partition=nosuchpartition",
        "--nodes",
        "1",
        "--gpus",
        "1",
        "--command",
        "true",
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert (
        "error[slurm.error]: sbatch refused the job: sbatch: error: invalid partition"
        in result.stderr
    )
    assert "nothing was submitted" in result.stderr
    assert list((tmp_path / "runs").iterdir()) == []


def test_pin_drift_refuses_to_submit_and_skip_pin_check_submits(tmp_path, drift_repo):
    refused = rlflow(
        "submit", str(TINY), "--nodes", "1", "--gpus", "1", "--command", "true", cwd=drift_repo
    )
    assert refused.returncode == 1
    assert "error[RF001]" in refused.stderr and "error[submit.pins]" in refused.stderr
    assert "submitted" not in refused.stdout and not (drift_repo / "runs").exists()
    job, run_dir = submit(
        TINY, "--nodes", "1", "--gpus", "1", "--skip-pin-check", cwd=drift_repo, command="true"
    )
    assert wait_done(job, 120, run_dir)["JobState"] == "COMPLETED"
    git = json.loads((run_dir / "git.json").read_text())
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=drift_repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    sub_head = subprocess.run(
        ["git", "rev-parse", "HEAD"],
        cwd=drift_repo / "submodules" / "dep",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert git == {
        "repository": str(drift_repo),
        "commit": head,
        "dirty": False,
        "changed_files": [],
        "submodules": [{"path": "submodules/dep", "commit": sub_head, "state": "matches"}],
    }
