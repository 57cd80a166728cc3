"""The tiny GRPO recipe trained twice, rollouts from Megatron and from vLLM: accuracy curves + numbers.

Usage (from the repository root; the vLLM environment must be built: `rlflow setup-env vllm`):

    uv run python benchmarks/vllm/compare_backends.py [--recipe R] [--runs-dir D] [OVERRIDES...]

Runs `rlflow train R generation.backend=<b> OVERRIDES --run-dir D/<b>` for b in megatron, vllm
(one after the other: each uses the whole machine), then writes next to this script:
  grpo_accuracy.png  val/accuracy of both runs in one plot (rlflow.launch.report.compare_runs)
  grpo_train_accuracy.png, grpo_tmpe.png  train/accuracy and token_mult_prob_error per step
  grpo_parity.json   per-run summary: accuracies, token_mult_prob_error median/max, step times
  grpo_recipe.resolved.yaml  the recipe both runs used (backend aside)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BACKENDS = ("megatron", "vllm")


def run(recipe: str, backend: str, run_dir: Path, overrides: list[str]) -> float:
    cmd = [
        sys.executable,
        "-m",
        "rlflow.cli",
        "train",
        recipe,
        f"generation.backend={backend}",
        "logging.progress_bar=false",
        *overrides,
        "--run-dir",
        str(run_dir),
    ]
    print("$", " ".join(cmd), flush=True)
    start = time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.monotonic() - start


def summary(run_dir: Path, wall_s: float) -> dict:
    from rlflow.train.metrics import read_metrics

    records = read_metrics(run_dir)
    steps = [r for r in records if "train/token_mult_prob_error" in r]
    val = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    mean = lambda key: statistics.fmean(r[key] for r in steps)  # noqa: E731
    tmpe = [r["train/token_mult_prob_error"] for r in steps]
    return {
        "wall_s": round(wall_s, 1),
        "val_accuracy": val,
        "train_accuracy_last10": round(
            statistics.fmean(r["train/accuracy"] for r in steps[-10:]), 4
        ),
        "tmpe_median": statistics.median(tmpe),
        "tmpe_max": max(tmpe),
        "tmpe_token_max": max(r["train/token_mult_prob_error_max"] for r in steps),
        "generation_s_per_step": round(mean("time/generation"), 4),
        "weight_refresh_s_per_step": round(mean("time/weight_refresh"), 4),
        "step_s": round(mean("time/step"), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml")
    parser.add_argument("--runs-dir", default="runs/bench-vllm", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from rlflow.launch.report import compare_runs

    dirs = {b: ROOT / args.runs_dir / b for b in BACKENDS}
    results = {}
    for backend, run_dir in dirs.items():
        if run_dir.exists():
            raise SystemExit(
                f"{run_dir} exists (a run there would resume): remove it or pick --runs-dir"
            )
        results[backend] = summary(run_dir, run(args.recipe, backend, run_dir, args.overrides))
    labels = [f"backend: {b}" for b in BACKENDS]
    runs = [dirs[b] for b in BACKENDS]
    for key, name, title in (
        ("val/accuracy", "grpo_accuracy", "validation accuracy (greedy)"),
        ("train/accuracy", "grpo_train_accuracy", "train accuracy (sampled)"),
        (
            "train/token_mult_prob_error",
            "grpo_tmpe",
            "token_mult_prob_error (generator vs trainer)",
        ),
    ):
        compare_runs(runs, labels, key, HERE / f"{name}.png", f"tiny GRPO, {title}")
    doc = {
        "command": " ".join([sys.argv[0], *sys.argv[1:]]),
        "recipe": args.recipe,
        "overrides": args.overrides,
        "results": results,
    }
    (HERE / "grpo_parity.json").write_text(json.dumps(doc, indent=2) + "\n")
    # The recipe exactly as both runs used it (the tiny recipe is still being tuned).
    (HERE / "grpo_recipe.resolved.yaml").write_text(
        (dirs["vllm"] / "recipe.resolved.yaml").read_text()
    )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
