"""Learning table (issue 32, item 3): multi-turn tool use (environment tool_scenes) against
single-turn GRPO on the same text counting scenes, same seed, on a CPU.

    nice -n 10 uv run python benchmarks/multiturn_learning.py --steps 10 --prompts 4 \
        --warm-start 40                                  # both runs, then the table
    uv run python benchmarks/multiturn_learning.py --analyze-only   # the table from saved runs
    ... --runs tools                                     # one run again, the table from both

Runs (`rlflow train`, the console script, one process each, side by side):
- tools:  recipes/tiny-qwen3-text-tools-1n1g-cpu.yaml (call `count`, then answer; 2 turns);
- single: recipes/tiny-qwen3-text-1n1g-cpu.yaml (answer at once, from the scene's description).
Both: the same scenes (data seeds 1 and 2, text rows, 1..3 objects), run.seed 42, --warm-start
supervised steps of 16 rows (each recipe's own reference: the whole tool trajectory, or the
answer), then --steps GRPO steps of --prompts prompts x 8, validation (greedy) on 32 held-out
scenes after the warm start (step 0) and at the end. Metrics are kept in
benchmarks/results/multiturn/<run>/metrics.jsonl; the table goes to stdout. Train columns are
sampled rollouts (temperature 1), the mean of the first 5 GRPO steps → of the last 5.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "multiturn"
RUNS = {
    "tools": ROOT / "recipes" / "tiny-qwen3-text-tools-1n1g-cpu.yaml",
    "single": ROOT / "recipes" / "tiny-qwen3-text-1n1g-cpu.yaml",
}


def rlflow() -> list[str]:
    """The console script (on PATH or beside this Python), else `python -m rlflow.cli`."""
    script = shutil.which("rlflow") or Path(sys.executable).parent / "rlflow"
    return [str(script)] if Path(script).exists() else [sys.executable, "-m", "rlflow.cli"]


def start(name: str, args) -> subprocess.Popen:
    run_dir = OUT / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    overrides = [
        "run.seed=42",
        f"grpo.max_num_steps={args.steps}",
        f"grpo.num_prompts_per_step={args.prompts}",
        "grpo.num_generations_per_prompt=8",
        "grpo.val_period=0",
        "grpo.max_val_samples=32",
        f"warm_start.num_steps={args.warm_start}",
        "warm_start.batch_size=16",
        "checkpointing.enabled=false",
        "logging.progress_bar=false",
    ]
    log = (run_dir / "train.log").open("w")
    command = [*rlflow(), "train", str(RUNS[name]), *overrides, "--run-dir", str(run_dir)]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def records(name: str) -> list[dict]:
    path = OUT / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _ends(train: list[dict], key: str) -> str:
    """The key's mean over the first and the last 5 GRPO steps (sampled rollouts)."""
    first, last = train[:5], train[-5:]
    if key not in train[0]:
        return "—"
    mean = lambda rs: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    return f"{mean(first):.3f} → {mean(last):.3f}"


def table() -> str:
    rows = [
        "| run | val accuracy before (step 0) | after | GRPO steps | turns / trajectory "
        "(val, last) | tool-call validity (val, last) | train accuracy | train reward | "
        "train tool-call validity | train answered without tool | response tokens (train, last) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in RUNS:
        recs = records(name)
        vals = [r for r in recs if "val/accuracy" in r]
        train = [r for r in recs if "train/reward" in r]
        if not vals:
            rows.append(f"| {name} | (stopped before the first validation) ||||||||||")
            continue
        first, last = vals[0], vals[-1]
        if not train:  # stopped after the warm start's validation: the "before" column only
            rows.append(f"| {name} | {first['val/accuracy']:.3f} | (stopped at step 0) |||||||||")
            continue
        turns = last.get("val/turns_per_trajectory", 1.0)
        validity = last.get("val/tool_call_validity")
        after = f"{last['val/accuracy']:.3f}" if last is not first else "(no final validation)"
        rows.append(
            f"| {name} | {first['val/accuracy']:.3f} | {after} | "
            f"{train[-1]['step']} | {turns:.2f} | "
            f"{'—' if validity is None else f'{validity:.3f}'} | "
            f"{_ends(train, 'train/accuracy')} | {_ends(train, 'train/reward')} | "
            f"{_ends(train, 'env/tool_call_validity')} | "
            f"{_ends(train, 'env/answered_without_tool')} | "
            f"{train[-1]['train/response_length']:.1f} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--warm-start", type=int, default=40)
    parser.add_argument("--analyze-only", action="store_true")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    args = parser.parse_args()
    if not args.analyze_only:
        began = time.perf_counter()
        procs = {name: start(name, args) for name in args.runs}
        codes = {name: p.wait() for name, p in procs.items()}
        print(f"runs finished in {time.perf_counter() - began:.0f} s: exit codes {codes}")
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
