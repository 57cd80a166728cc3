"""Separate placement with expert parallelism on the trainers (CPU, gloo): the real
`rlflow train --nproc 3` of the tiny Qwen3-MoE (8 experts), 2 training ranks at EP 2 (4 experts
each) and 1 generation rank holding all 8. The weight sync sends each EP rank's experts from
that rank, named by global index (rlflow/train/generation_role/weight_sync.py); after every
sync the fingerprint check compares every tensor, each EP rank's experts included, with the
generation rank's, and stops the run on any difference."""

from __future__ import annotations

import os
import subprocess

from rlflow.train.metrics import read_metrics
from tests.train.test_train_runs import CONSOLE_SCRIPT, ROOT

RECIPE = ROOT / "recipes" / "tiny-qwen3-moe-text-1n1g-cpu.yaml"
ONE_STEP_OFF_EP2 = [
    "generation.placement=separate",
    "generation.gpus_per_node=1",
    "async_grpo.max_staleness=1",
    "parallelism.expert_parallel_size=2",
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
    "logging.progress_bar=false",
]


def test_expert_parallel_trainers_sync_every_expert_to_the_generation_rank(tmp_path):
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    result = subprocess.run(
        [CONSOLE_SCRIPT, "train", str(RECIPE), *ONE_STEP_OFF_EP2, "--run-dir", str(tmp_path),
         "--nproc", "3"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**clean, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = read_metrics(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["async/weight_version"] for r in steps] == [0.0, 0.0, 1.0]
    # the weights of step 1 went to the generation rank (batch 3 used them) and passed the check
    assert ["time/weight_sync" in r for r in steps] == [True, False, False]
    log = (tmp_path / "logs" / "rank-2.log").read_text()
    assert "Traceback" not in log
