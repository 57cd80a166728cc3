"""Asynchronous GRPO through `rlflow submit` on the real local Slurm cluster: one node of 3
ranks, 2 training and 1 generating (generation.placement separate), one-step-off."""

from __future__ import annotations

import json

import pytest

from tests.slurm.jobs import REPO, batch_log, submit, wait_done

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def test_one_step_off_trains_under_slurm(tmp_path):
    job, run_dir = submit(
        REPO / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml",
        f"run.output_dir={tmp_path}",
        "generation.placement=separate",
        "generation.gpus_per_node=1",
        "async_grpo.max_staleness=1",
        "grpo.max_num_steps=3",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.num_minibatches=1",
        "warm_start.num_steps=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "checkpointing.enabled=false",
        "--nodes",
        "1",
        "--gpus",
        "3",
        cwd=REPO,
    )
    fields = wait_done(job, timeout=600, run_dir=run_dir)
    log = batch_log(run_dir, job)
    assert fields["JobState"] == "COMPLETED", log
    assert "placement: ranks 0-1 train, rank 2 generates (generation.placement separate)" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["async/staleness"] for r in records] == [0.0, 1.0, 1.0]
    assert "time/weight_sync" in records[0]
    assert (run_dir / "logs" / "rank-2.log").exists()
