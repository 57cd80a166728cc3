"""Asynchronous GRPO on CPU: generation ranks of their own, the weight sync, the tripwires.

Every run is the real `rlflow train --nproc N` (gloo): the node launcher, training ranks and a
generation rank running the Megatron engine. One-step-off (async_grpo.max_staleness 1) with
1 generation rank and 2 data-parallel training ranks is the main run, shared by the tests that
read it; a second run of the same recipe is killed (SIGKILL) mid-run and resumed. Each other
fault is injected into a smaller run of 1 + 1 ranks (rlflow/train/faults.py) and must end the
job with its root cause, long before any collective timeout (the subprocess timeout is the hang
detector). The schedule and the trainer's version tripwire: test_train_remote.py.
"""

from __future__ import annotations

import json

import pytest

from rlflow.train.metrics import read_metrics
from tests.train.test_train_runs import comparable, train

ONE_STEP_OFF = [
    "generation.placement=separate",
    "generation.gpus_per_node=1",
    "async_grpo.max_staleness=1",
]
# The main run and the killed one: 4 steps (checkpoints at 2 and 4), one validation at the end,
# a short warm start (the weights of version 0 are then the warm start's, not the checkpoint's).
# Small steps (one prompt per training rank, 2 rollouts each, still 2 minibatches): what is
# looked at is the versions, the syncs and the metrics' equality, not what was learned.
MAIN = [
    *ONE_STEP_OFF,
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.val_at_start=false",
    "grpo.val_period=0",
    "warm_start.num_steps=2",
]
# Faults: 1 trainer + 1 generation rank, 3 steps (the weights of step 1 are synced for batch
# 3), nothing else to wait for.
SMALL_FAULT = [
    *ONE_STEP_OFF,
    "grpo.max_num_steps=3",
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.num_minibatches=1",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "warm_start.num_steps=0",
    "checkpointing.enabled=false",
    "preflight.enabled=false",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="module")
def one_step_off(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one-step-off")
    result = train(run_dir, *MAIN, nproc=3)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def test_one_step_off_trains_with_versions_checked_and_weights_synced(one_step_off):
    steps = read_metrics(one_step_off)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # batch 1 from the start weights, then every batch one step behind
    assert [r["async/staleness"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/weight_version"] for r in steps] == [0.0, 0.0, 1.0, 2.0]
    # the weights of steps 1 and 2 are synced (batches 3 and 4 use them); 3 and 4 are not needed
    assert ["time/weight_sync" in r for r in steps] == [True, True, False, False]
    for r in steps:
        assert r["time/generation"] > 0 and "time/wait_rollouts" in r
        assert "train/is_weight_mean" in r  # importance sampling: on by default in async mode
    assert "val/accuracy" in steps[-1]
    log = (one_step_off / "logs" / "rank-2.log").read_text()
    assert "Traceback" not in log


def test_one_step_off_is_deterministic_and_resumes_after_kill_9(one_step_off, tmp_path):
    """The trainer is killed (SIGKILL) at the start of step 3, while the generation rank holds
    batch 3, generated ahead, and waits for the trainer's order: the job ends at once, naming
    the dead trainer (a trainer rank that dies while generation ranks wait). The rerun resumes
    from step 2's checkpoint: every step once."""
    crashed = train(tmp_path, *MAIN, nproc=3, env={"RLFLOW_TEST_KILL": "0:step3"}, timeout=300)
    output = crashed.stdout + crashed.stderr
    assert crashed.returncode != 0
    assert "rank 0 exited with code 137" in output, output  # 128 + SIGKILL
    generator = (tmp_path / "logs" / "rank-2.log").read_text()
    assert "Traceback" not in generator, generator
    reference = read_metrics(one_step_off)
    # Up to the crash, a second run with the same seed logged exactly the same metrics.
    assert comparable(read_metrics(tmp_path)) == comparable(reference[:2])
    resumed = train(tmp_path, *MAIN, nproc=3)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # the restart's first batch comes from the checkpoint's own weights (version 2)
    assert [r["async/weight_version"] for r in records[2:]] == [2.0, 2.0]


def fault_run(tmp_path, env: dict, *overrides: str):
    result = train(tmp_path, *SMALL_FAULT, *overrides, nproc=2, env=env, timeout=300)
    logs = {p.name: p.read_text() for p in sorted((tmp_path / "logs").glob("rank-*.log"))}
    return result, result.stdout + result.stderr, logs


@pytest.mark.parametrize(
    "fault, rank",
    [("RLFLOW_TEST_FAIL", "0"), ("RLFLOW_TEST_FAIL", "1")],
    ids=["trainer-side", "generation-side"],
)
def test_a_sync_that_raises_ends_the_job_naming_it(fault, rank, tmp_path):
    result, output, logs = fault_run(tmp_path, {fault: f"{rank}:sync1"})
    assert result.returncode == 1
    assert f"rank {rank} exited with code 1" in output
    assert (
        logs[f"rank-{rank}.log"].count(f"error: RuntimeError: injected failure on rank {rank}") == 1
    )
    other = logs[f"rank-{1 - int(rank)}.log"]
    assert "Traceback" not in other and "injected failure" not in other


def test_a_generation_rank_that_dies_ends_the_job(tmp_path):
    result, output, logs = fault_run(tmp_path, {"RLFLOW_TEST_KILL": "1:step2"})
    assert result.returncode != 0
    assert "rank 1 exited with code 137" in output, output  # 128 + SIGKILL
    assert "Traceback" not in logs["rank-0.log"]


def test_a_generation_rank_that_hangs_is_named_by_the_watchdog(tmp_path):
    result, output, logs = fault_run(
        tmp_path, {"RLFLOW_TEST_HANG": "1:step2"}, "watchdog.phase_timeout_s=10"
    )
    assert result.returncode != 0
    # the hung rank is named, in its own phase; the waiting trainer is not
    assert "rank 1 (" in output and "in phase `generation` at step 2" in output, output
    assert "rank 0 (" not in output


def test_torn_weights_fail_the_fingerprint_check(tmp_path):
    result, output, logs = fault_run(tmp_path, {"RLFLOW_TEST_TEAR": "1:sync1"})
    assert result.returncode != 0
    message = (
        "after the weight sync of version 1, generation rank 1's weights are not the trainer's"
    )
    assert output.count(message) == 1, output
    assert "Traceback" not in logs["rank-1.log"]


def test_weights_wrong_past_the_fingerprint_stop_the_run_at_its_first_fresh_step(tmp_path):
    """A generation rank whose weights go wrong after the first sync passed its fingerprint
    check (a resharding bug both sides agree on, as the Mamba cut once was): step 1 trains on
    rollouts of its own weights, their mult-prob error (1.39: the tiny model's distributions
    are nearly flat, so 1.1 stands in for base.yaml's 1.5) is above
    `loss.stop_on_mult_prob_error`, and the run stops naming it, before step 1 is logged."""
    result, output, _ = fault_run(
        tmp_path, {"RLFLOW_TEST_SKEW": "1:sync0"}, "loss.stop_on_mult_prob_error=1.1"
    )
    assert result.returncode != 0
    assert "error[train.engine-mismatch]: step 1: the generation engine's logprobs" in output
    assert "> loss.stop_on_mult_prob_error 1.1" in output, output
    metrics = tmp_path / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    assert 1 not in [json.loads(line)["step"] for line in lines]
