"""Tune the tiny CPU recipe: run several override sets of it concurrently, report validation accuracy.

Each configuration is a full `rlflow train` run (warm start, then GRPO) of
recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml. Runs go in parallel (one process each), so on a GPU
machine with many cores a sweep costs the time of one run.

    python benchmarks/tiny_recipe_sweep.py --out DIR [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml"
CONFIGS = {
    "lr3e-4_p8": ["optimizer.lr=3.0e-4"],
    "lr1e-3_p8": ["optimizer.lr=1.0e-3"],
    "lr3e-4_p16": ["optimizer.lr=3.0e-4", "grpo.num_prompts_per_step=16"],
    "lr1e-3_p16": ["optimizer.lr=1.0e-3", "grpo.num_prompts_per_step=16"],
    "lr3e-4_p16_t07": [
        "optimizer.lr=3.0e-4",
        "grpo.num_prompts_per_step=16",
        "generation.temperature=0.7",
    ],
    "lr1e-3_p16_ws25": [
        "optimizer.lr=1.0e-3",
        "grpo.num_prompts_per_step=16",
        "warm_start.num_steps=25",
    ],
    "lr3e-4_p16_mb1": [
        "optimizer.lr=3.0e-4",
        "grpo.num_prompts_per_step=16",
        "grpo.num_minibatches=1",
    ],
    "lr1e-4_p16_ws60": [
        "optimizer.lr=1.0e-4",
        "grpo.num_prompts_per_step=16",
        "warm_start.num_steps=60",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--only", default="", help="comma-separated config names (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(CONFIGS)
    common = [
        f"grpo.max_num_steps={args.steps}",
        "grpo.val_period=20",
        "grpo.max_val_samples=128",
        "logging.progress_bar=false",
        "checkpointing.enabled=false",
        "generation.compile_decode=false",
    ]
    procs = {}
    start = time.perf_counter()
    for name in names:
        run_dir = Path("/tmp/rlflow-sweep") / name
        command = [
            sys.executable,
            "-m",
            "rlflow.cli",
            "train",
            RECIPE,
            *common,
            *CONFIGS[name],
            "--run-dir",
            str(run_dir),
        ]
        log = open(args.out / f"{name}.log", "w")
        procs[name] = (
            subprocess.Popen(
                command,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"},
            ),
            run_dir,
        )
    summary = {}
    for name, (proc, run_dir) in procs.items():
        code = proc.wait()
        metrics = run_dir / "metrics.jsonl"
        curve = []
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                record = json.loads(line)
                if "val/accuracy" in record:
                    curve.append((record["step"], round(record["val/accuracy"], 3)))
            (args.out / f"{name}.metrics.jsonl").write_text(metrics.read_text())
        summary[name] = {"exit": code, "overrides": CONFIGS[name], "val_accuracy": curve}
        print(name, json.dumps(summary[name]), flush=True)
    summary["_wall_s"] = time.perf_counter() - start
    (args.out / "sweep.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
