"""Exactly-once metrics: a run killed (SIGKILL, no cleanup) at each phase boundary of a step and
run again with the same command holds every step once in metrics.jsonl, TensorBoard and W&B
(offline), with the values of the attempt that produced the checkpoint it resumed from.

One run directory is killed again and again, each time at a later boundary, so three trainer
runs cover the states a kill can leave (rlflow/train/faults.py names the phases, and the rank
kills itself there: no sleeps, no races):

    saving2    steps 1-2 logged, step 2's checkpoint written but not in place: no checkpoint,
               the rerun starts over
    logged3    checkpoint 2 complete, step 3 logged after it: the rerun resumes from step 2

A kill anywhere else leaves one of these states: before a step's `logged` boundary, the
previous boundary's; after `saved`, nothing to cut. The async run (a generation rank of its
own) is killed on its training rank before its first checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.train.metrics import read_metrics
from rlflow.train.wandb_log import state as wandb_state
from tests.train.test_train_wandb_log import WANDB, offline_run

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
RLFLOW = Path(sys.executable).parent / "rlflow"  # the console script users run
TINY = [
    "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2",
    "grpo.num_minibatches=1",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "warm_start.num_steps=0",
    "checkpointing.save_period=2",
    "logging.progress_bar=false",
    "generation.max_new_tokens=4",
    "data.train.num_samples=64",
    "preflight.enabled=false",
]
KILLED = 128 + 9  # the launcher's exit code for a rank that died of SIGKILL


def train(
    run_dir: Path, *overrides: str, nproc: int, kill: str = "", env: dict | None = None
) -> list[int]:
    """`rlflow train RECIPE ... --nproc N`, with rank RANK killed at PHASE when kill is
    "RANK:PHASE"; the steps metrics.jsonl holds afterwards."""
    skip = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    clean = {k: v for k, v in os.environ.items() if k not in skip and not k.startswith("SLURM")}
    done = subprocess.run(
        [str(RLFLOW), "train", str(RECIPE), *TINY, *overrides]
        + ["--nproc", str(nproc), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard, not a speed check
        env={**clean, **(env or {}), "RLFLOW_TEST_KILL": kill},
    )
    output = done.stdout + done.stderr
    # One rank runs in the `rlflow` process itself: its kill is the command's.
    expected = (-9 if nproc == 1 else KILLED) if kill else 0
    assert done.returncode == expected, output[-4000:]
    if kill and nproc > 1:
        assert f"exited with code {KILLED} (killed by SIGKILL)" in output, output[-4000:]
    return [r["step"] for r in read_metrics(run_dir)]


def tensorboard_scalars(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """What TensorBoard's own reader shows, every attempt's event file read in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


def test_a_run_killed_at_each_phase_boundary_logs_every_step_once(tmp_path, tiny_ckpt):
    run, wandb_dir = tmp_path / "run", tmp_path / "wandb-files"
    args = (
        f"model.checkpoint={tiny_ckpt}",
        "grpo.max_num_steps=3",
        "logging.tensorboard=true",
        *WANDB,
    )
    env = {"WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    # Step 2's checkpoint written, not in place; steps 1 and 2 logged.
    assert train(run, *args, nproc=1, kill="0:saving2", env=env) == [1, 2]
    assert (run / "checkpoints" / "step_000002.tmp").is_dir()
    assert not (run / "checkpoints" / "step_000002").exists()
    first_wandb = wandb_state(run)[0]
    # No checkpoint: this attempt starts over, saves step 2, and dies after logging step 3.
    assert train(run, *args, nproc=1, kill="0:logged3", env=env) == [1, 2, 3]
    survivor = read_metrics(run)[:2]  # the attempt whose checkpoint the last run resumes from
    second_wandb = wandb_state(run)[0]
    # Resumed from step 2: step 3 runs again.
    assert train(run, *args, nproc=1, env=env) == [1, 2, 3]
    final = read_metrics(run)
    assert final[:2] == survivor  # every value, timings included: not a rerun's
    tensorboard = tensorboard_scalars(run, "train/reward")
    assert [step for step, _ in tensorboard] == [1, 2, 3]
    assert [value for _, value in tensorboard] == pytest.approx([r["train/reward"] for r in final])
    time_shown = [value for _, value in tensorboard_scalars(run, "time/step")]
    assert time_shown == pytest.approx([r["time/step"] for r in final])
    # W&B: each attempt after a cut is a new run; the last one holds steps 1-3 as metrics.jsonl.
    last_wandb, held = wandb_state(run)
    assert len({first_wandb, second_wandb, last_wandb}) == 3 and held == 3
    _, _, history = offline_run(wandb_dir, last_wandb, 0)
    assert sorted(history) == [1, 2, 3]
    for record in final:
        for key in ("train/reward", "time/step"):
            assert history[record["step"]][key] == pytest.approx(record[key], rel=1e-6)


def test_an_async_run_whose_training_rank_is_killed_logs_every_step_once(tmp_path, tiny_ckpt):
    """generation.placement=separate: rank 0 trains, rank 1 generates ahead. Rank 0 dies after
    logging step 1, before any checkpoint; the rerun starts over."""
    run = tmp_path / "run"
    args = (
        f"model.checkpoint={tiny_ckpt}",
        "grpo.max_num_steps=2",
        "generation.placement=separate",
        "generation.gpus_per_node=1",
        "async_grpo.max_staleness=1",
        "logging.tensorboard=false",
    )
    assert train(run, *args, nproc=2, kill="0:logged1") == [1]
    assert train(run, *args, nproc=2) == [1, 2]
