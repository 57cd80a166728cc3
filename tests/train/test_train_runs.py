"""End-to-end `rlflow train` runs of the tiny recipe on CPU, each in its own process (real
megatron-core model, real generation, real checkpoints)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
RECIPE_MODEL = "tiny-qwen25vl-seed0"  # the recipe's builtin model, under the run's model/
CONSOLE_SCRIPT = str(Path(sys.executable).with_name("rlflow"))  # as users run it
# Small and fast: 8 prompts x 4 generations, short answers, a few warm-start steps.
SMALL = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=4",
    "grpo.num_minibatches=2",
    "grpo.val_period=2",
    "grpo.max_val_samples=8",
    "warm_start.num_steps=6",
    "warm_start.batch_size=8",
    "checkpointing.save_period=2",
    "checkpointing.keep_last=3",
    "logging.progress_bar=false",
    "data.train.num_samples=256",
]


def train(
    run_dir: Path, *overrides: str, nproc: int = 1, env: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    command = [
        CONSOLE_SCRIPT,
        "train",
        str(RECIPE),
        *SMALL,
        *overrides,
        "--run-dir",
        str(run_dir),
    ]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    # A fresh process: no rendezvous variables inherited from the test process.
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**clean, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


# Measured, not computed: wall-clock times, tokens per wall-clock second, process memory.
MEASURED = ("time/", "speed/", "memory/")


def comparable(records: list[dict]) -> list[dict]:
    """Metrics without the measured ones (MEASURED), which legitimately differ between runs."""
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in records]


def same_checkpoint(a: Path, b: Path) -> None:
    """Two checkpoints of one step hold the same trainer.json and, tensor for tensor, the same
    weights, optimizer state and RNG states (what a resume continues from)."""
    import torch

    assert json.loads((a / "trainer.json").read_text()) == json.loads(
        (b / "trainer.json").read_text()
    )
    for name in ("model_tp0_pp0.pt", "optim_tp0_pp0.pt", "rng_rank0.pt"):
        want, got = (torch.load(d / name, weights_only=False) for d in (a, b))
        assert _flat(got) == _flat(want), f"{b.name}/{name} differs from {a}"


def _flat(obj, prefix: str = "") -> dict:
    """{path: value} with tensors and arrays as bytes, so == compares them exactly."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _flat(val, f"{prefix}/{i}").items()}
    import numpy as np
    import torch

    if torch.is_tensor(obj):
        raw = obj.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        return {prefix: (str(obj.dtype), tuple(obj.shape), raw)}
    if isinstance(obj, np.ndarray):
        return {prefix: (str(obj.dtype), obj.shape, obj.tobytes())}
    return {prefix: obj}


def uncompiled_megatron(folder: Path) -> dict[str, str]:
    """The environment of a process that finds no bytecode for megatron's sources (a fresh
    install's first run, or every run under PYTHONDONTWRITEBYTECODE): megatron's files, linked
    into `folder` without their __pycache__, come first on PYTHONPATH, so Python compiles them
    (and nothing else) from source."""
    import importlib.util

    core = importlib.util.find_spec("megatron.core").origin  # found, not imported
    installed = Path(core).parents[1]  # site-packages/megatron, a namespace package
    for source in installed.rglob("*"):
        relative = source.relative_to(installed.parent)
        if source.is_file() and "__pycache__" not in relative.parts:
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).symlink_to(source)
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    }


@pytest.fixture(scope="module")
def reference_output(tmp_path_factory) -> tuple[Path, str]:
    """The reference run (rank 0 of one) and what it printed, run as on a fresh install."""
    run_dir = tmp_path_factory.mktemp("reference")
    fresh = uncompiled_megatron(tmp_path_factory.mktemp("uncompiled"))
    result = train(run_dir, env={"PYTHONHASHSEED": "0", **fresh})
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stdout + result.stderr


@pytest.fixture(scope="module")
def reference_run(reference_output) -> Path:
    return reference_output[0]


def test_start_up_says_what_it_checked_and_nothing_else(reference_output):
    """One CPU rank: the preflight names only the checks that had something to check (no
    "gpus" without GPUs, no all-reduce bandwidth for one rank); the model's loading is one whole
    line, printed once (not the bridge's progress bar for the policy and again for the
    reference model); megatron-core's SyntaxWarnings while Python compiles it are filtered."""
    run_dir, output = reference_output
    [preflight] = [line for line in output.splitlines() if line.startswith("preflight:")]
    assert preflight.startswith("preflight: 1 node passed (disk); preflight took ")
    [loaded] = [line for line in output.splitlines() if line.startswith("model: loaded ")]
    assert f"model/{RECIPE_MODEL}" in loaded and "float32" in loaded
    assert "Loading from" not in output and "number of parameters" not in output
    assert "Warning" not in output, output[:3000]


def test_run_writes_metrics_checkpoints_and_tensorboard(reference_run):
    records = read_metrics(reference_run)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    step = records[1]
    for key in (
        "train/reward",
        "train/accuracy",
        "train/kl",
        "train/clip_fraction",
        "train/entropy",
        "train/response_length",
        "train/token_mult_prob_error",
        "time/generation",
        "time/logprobs",
        "time/training",
    ):
        assert key in step, key
    assert "val/accuracy" in records[0] and "val/accuracy" in records[2]
    checkpoints = sorted(p.name for p in (reference_run / "checkpoints").iterdir())
    assert checkpoints == ["reference", "step_000002", "step_000004"]
    assert list((reference_run / "tensorboard").glob("events.out.tfevents.*"))


def test_generator_and_trainer_agree_on_logprobs(reference_run):
    """token_mult_prob_error: Megatron generation vs the trainer's recomputation (fp32, CPU)."""
    errors = [
        r["train/token_mult_prob_error"] for r in read_metrics(reference_run) if r["step"] > 0
    ]
    maxima = [
        r["train/token_mult_prob_error_max"] for r in read_metrics(reference_run) if r["step"] > 0
    ]
    assert sorted(errors)[len(errors) // 2] <= 1.05
    assert max(maxima) <= 1.10


def test_a_run_stopped_by_the_warning_then_killed_resumes_with_identical_metrics(
    reference_run, tmp_path
):
    """The warning (slurm.stop_signal, HUP) -> checkpoint at the step boundary, exit 75; the
    rerun resumes, is killed in step 3 (an injected failure), and the next rerun finishes with
    the metrics of the uninterrupted run. (One run for both interruptions: each costs a whole
    run's start.)"""
    # Each process salts str hashes differently (as separate requeues do): state that depends
    # on set or hash order differs between them every time, not only now and then.
    stopped = train(tmp_path, env={"RLFLOW_TEST_SIGNAL": "0:step1:HUP", "PYTHONHASHSEED": "1"})
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "step_000001").is_dir()
    crashed = train(tmp_path, env={"RLFLOW_TEST_FAIL": "0:step3", "PYTHONHASHSEED": "2"})
    assert crashed.returncode != 0
    assert "resumed from" in crashed.stderr
    assert "injected failure on rank 0 during step3" in crashed.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    # step 2 was written by a resumed run: the next resume starts from it
    same_checkpoint(reference_run / "checkpoints/step_000002", tmp_path / "checkpoints/step_000002")
    resumed = train(tmp_path, env={"PYTHONHASHSEED": "3"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    same_checkpoint(reference_run / "checkpoints/step_000004", tmp_path / "checkpoints/step_000004")
    assert comparable(read_metrics(tmp_path)) == comparable(read_metrics(reference_run))


def test_report_writes_png_plots(reference_run, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rlflow.cli", "report", str(reference_run), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    for name in ("reward", "accuracy", "kl", "step_time"):
        data = (tmp_path / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_half_precision_on_the_cpu_is_refused_naming_the_key(tmp_path):
    """megatron-core's mixed-precision optimizer takes CUDA tensors only: on the CPU a bf16
    recipe ends with rlflow's error naming `model.dtype`, not megatron's TypeError."""
    result = train(tmp_path, "model.dtype=bfloat16", "grpo.max_num_steps=1")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error[train.dtype-device]: `model.dtype` bfloat16 trains on GPUs only" in result.stderr
    assert "set model.dtype=float32" in result.stderr and "Traceback" not in result.stderr
