"""Short GRPO runs of the tiny CPU recipe with `generation.backend=vllm` (`rlflow train`, real vLLM).

What the backend must give the trainer: logprobs that the trainer's own forward reproduces
(token_mult_prob_error ~ 1), weights refreshed every step, and a run that stops, with vLLM's
error and no process left behind, when a refresh fails. The long accuracy comparison with the
Megatron backend is benchmarks/vllm/compare_backends.py.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import TINY_CPU_RECIPE

SHORT_RUN = [
    "generation.backend=vllm",
    "generation.vllm.device=cpu",
    "grpo.max_num_steps=3",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.num_minibatches=1",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
    "grpo.val_period=0",
    "warm_start.num_steps=2",
    "checkpointing.enabled=false",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
]


def train(run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # A single-rank run of its own: not the rendezvous this test process may have set up.
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rlflow.cli",
            "train",
            str(TINY_CPU_RECIPE),
            *SHORT_RUN,
            *overrides,
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=TINY_CPU_RECIPE.parents[1],
        timeout=900,
    )


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def worker_pid(run_dir: Path) -> int:
    first = (run_dir / "vllm" / "worker-rank0.log").read_text().splitlines()[0]
    return int(re.match(r"rlflow-vllm-worker: pid (\d+)", first)[1])


def assert_gone(pid: int) -> None:
    from tests.generation.test_generation_vllm_failures import wait_gone

    assert wait_gone(pid), f"vLLM worker {pid} outlived the run"


@pytest.mark.timeout(900)
def test_grpo_with_vllm_matches_the_trainers_logprobs(vllm_env, tmp_path):
    result = train(tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in metrics(tmp_path / "run") if "train/token_mult_prob_error" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    tmpe = [r["train/token_mult_prob_error"] for r in steps]
    assert statistics.median(tmpe) <= 1.05 and max(tmpe) <= 1.10, tmpe
    assert max(r["train/token_mult_prob_error_max"] for r in steps) <= 1.10  # worst single token
    assert all(r["time/weight_refresh"] > 0 for r in steps)  # refreshed after every update
    # importance_sampling.mode auto is TIS for vLLM rollouts: weights ~1, logged beside TMPE
    assert all(abs(r["train/is_weight_mean"] - 1) < 0.05 for r in steps)
    assert all(r["train/is_clipped_fraction"] <= 0.01 for r in steps)
    assert_gone(worker_pid(tmp_path / "run"))


@pytest.mark.timeout(900)
def test_a_failed_weight_refresh_stops_the_run(vllm_env, tmp_path):
    # Refresh 1 is at start-up, 2 after the warm start, 3 after GRPO step 1's update.
    result = train(tmp_path / "run", env={"RLFLOW_TEST_FAIL": "0:vllm-refresh3"})
    assert result.returncode != 0
    assert "vLLM weight refresh failed" in result.stderr
    assert "Attempted to load weight" in result.stderr  # vLLM's own error reaches the user
    assert not [r for r in metrics(tmp_path / "run") if r.get("step", 0) >= 1]  # step 1 never done
    assert_gone(worker_pid(tmp_path / "run"))


def test_a_missing_environment_stops_the_run_before_any_model_is_loaded(tmp_path):
    result = train(tmp_path / "run", f"generation.vllm.env_root={tmp_path / 'no-envs'}")
    assert result.returncode == 1
    assert "error[vllm.env-missing]" in result.stderr and "rlflow setup-env vllm" in result.stderr
    assert not (tmp_path / "run" / "model").exists()  # failed before building or loading the model
