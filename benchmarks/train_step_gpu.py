"""GRPO step time on one GPU: the tiny CPU recipe, and a Qwen2.5-VL-3B-shaped model (random weights).

Runs `python -m rlflow.cli train` (the same entry point `rlflow submit` starts on every rank) and
summarises each run's metrics.jsonl: step time and its breakdown (generation / logprobs /
training), peak memory, training tokens per second, TMPE.

    python benchmarks/train_step_gpu.py --out DIR [--steps-3b 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = {
    "tiny-cpu-recipe-on-gpu": (
        "recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml",
        [
            "grpo.max_num_steps=20",
            "grpo.val_period=10",
            "logging.progress_bar=false",
            "checkpointing.enabled=false",
        ],
    ),
    "qwen25vl-3b-random-1gpu": (
        "recipes/vlm_grpo-qwen25vl-3b-clevr-4n8g-megatron-tp2.yaml",
        [
            "parallelism.tensor_parallel_size=1",
            "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=8",
            "generation.max_new_tokens=128",
            "optimizer.micro_batch_size=8",
            "optimizer.max_tokens_per_micro_batch=0",  # (else the recipe's token budget rules)
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "checkpointing.enabled=false",
            "data.max_objects=4",
        ],
    ),
}


def summarise(run_dir: Path) -> dict:
    from rlflow.train.metrics import read_metrics

    steps = [r for r in read_metrics(run_dir) if "time/step" in r]
    later = steps[1:] or steps  # the first step includes CUDA-graph capture and allocator warm-up

    def med(key):
        return statistics.median(r[key] for r in later if key in r)

    return {
        "steps": len(steps),
        "step_s_median": med("time/step"),
        "generation_s": med("time/generation"),
        "logprobs_s": med("time/logprobs"),
        "training_s": med("time/training"),
        "reward_s": med("time/reward"),
        "train_tokens_per_s": med("time/tokens_per_second"),
        "peak_gib": max(r.get("memory/peak_gib", 0.0) for r in steps),
        "token_mult_prob_error_median": med("train/token_mult_prob_error"),
        "token_mult_prob_error_max": max(r["train/token_mult_prob_error_max"] for r in steps),
        "response_length": med("train/response_length"),
        "first_step_s": steps[0]["time/step"],
        "allocated_gib_per_step": [round(r.get("memory/allocated_gib", 0.0), 3) for r in steps],
        "peak_gib_per_step": [round(r.get("memory/peak_gib", 0.0), 3) for r in steps],
        "val_accuracy": [
            (r["step"], r["val/accuracy"]) for r in read_metrics(run_dir) if "val/accuracy" in r
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps-3b", type=int, default=4)
    parser.add_argument("--checkpoint-3b", type=Path, default=Path("/tmp/rlflow-bench-3b"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.checkpoint_3b / "config.json").exists():
        from rlflow.model.tiny import PRESETS, write_tiny_checkpoint

        write_tiny_checkpoint(
            args.checkpoint_3b, seed=0, sizes=PRESETS["qwen25vl-3b"], device="cuda"
        )
    results = {}
    for name, (recipe, overrides) in RUNS.items():
        run_dir = Path("/tmp/rlflow-bench-runs") / name
        extra = []
        if "3b" in name:
            extra = [
                f"model.checkpoint={args.checkpoint_3b}",
                f"grpo.max_num_steps={args.steps_3b}",
            ]
        command = [
            sys.executable,
            "-m",
            "rlflow.cli",
            "train",
            recipe,
            *overrides,
            *extra,
            "--run-dir",
            str(run_dir),
        ]
        start = time.perf_counter()
        proc = subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        (args.out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        row = {
            "command": " ".join(command[1:]),
            "exit_code": proc.returncode,
            "wall_s": time.perf_counter() - start,
        }
        if proc.returncode == 0:
            row.update(summarise(run_dir))
        else:
            row["stderr_tail"] = proc.stderr[-2000:]
        results[name] = row
        print(name, json.dumps(row, indent=1), flush=True)
        (args.out / "train_results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
