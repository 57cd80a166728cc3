"""Learning with partial rollouts (issue 34): the tiny CPU recipe with a low generation budget
against the same recipe without, same seeds, same steps; the final validation accuracy of each.

    # one niced background job per seed (the machine has 2 shared cores), then the table:
    for s in 42 43 44; do nice -n 10 uv run python benchmarks/partial_rollouts_learning.py \
        --steps 40 --seeds $s & done; wait
    uv run python benchmarks/partial_rollouts_learning.py --steps 40 --analyze-only

Each run is `rlflow train recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml` (45 warm-start steps, 16
prompts x 8 generations per step, 8 new tokens at most) for --steps GRPO steps, validation on
the 64 held-out scenes every 10 steps and at the end, run.seed as given. `partial`: budget 2
decode steps per step (a row of 8 tokens needs 4 steps), max_staleness_steps 3. Metrics of
every run are kept in benchmarks/results/partial/; the results file is
benchmarks/partial_rollouts_learning.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
OUT = ROOT / "benchmarks" / "results" / "partial"
SEEDS = (42, 43, 44)
CONFIGS = {
    "off": [],
    "partial": [
        "generation.partial_rollouts.enabled=true",
        "generation.partial_rollouts.budget_steps=2",
        "generation.partial_rollouts.max_staleness_steps=3",
    ],
}


def run(config: str, seed: int, steps: int) -> None:
    dest = OUT / f"{config}-s{seed}-n{steps}.jsonl"
    if dest.exists():
        return
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            str(ROOT / ".venv" / "bin" / "rlflow"), "train", str(RECIPE),
            f"grpo.max_num_steps={steps}", "grpo.val_period=10", f"run.seed={seed}",
            "checkpointing.enabled=false", "logging.progress_bar=false",
            "logging.tensorboard=false", *CONFIGS[config], "--run-dir", tmp,
        ]  # fmt: skip
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if result.returncode != 0:
            print(f"{config} seed {seed}: exit {result.returncode}\n{result.stderr[-2000:]}")
            return
        OUT.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "metrics.jsonl", dest)
        print(f"{config} seed {seed}: {time.perf_counter() - start:.0f} s", flush=True)


def summary(steps: int) -> dict:
    """Per config: each seed's validation accuracy at the start and the end, the mean."""
    out = {}
    for config in CONFIGS:
        rows = {}
        for seed in SEEDS:
            path = OUT / f"{config}-s{seed}-n{steps}.jsonl"
            if not path.exists():
                continue
            records = [json.loads(line) for line in path.read_text().splitlines() if line]
            val = [r["val/accuracy"] for r in records if "val/accuracy" in r]
            stale = sum(r.get("partial/rows_dropped_stale", 0) for r in records)
            rows[seed] = {"start": val[0], "end": val[-1], "stale_rows": stale}
        if rows:
            ends = [r["end"] for r in rows.values()]
            out[config] = {"seeds": rows, "mean_end": statistics.mean(ends)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    parser.add_argument("--analyze-only", action="store_true")
    args = parser.parse_args()
    if not args.analyze_only:
        for seed in args.seeds:
            for config in CONFIGS:
                run(config, seed, args.steps)
    print(json.dumps(summary(args.steps), indent=2))


if __name__ == "__main__":
    main()
