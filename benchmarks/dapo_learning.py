"""Learning table (issue 12): plain GRPO vs DAPO dynamic sampling vs dynamic sampling + overlong
shaping on the tiny CPU task, 3 seeds each, compared at the same budget of generated tokens.

    # one niced background job per seed (the machine has 2 shared cores), then the table:
    for s in 42 43 44; do nice -n 10 uv run python benchmarks/dapo_learning.py --steps 30 \
        --prompts 8 --seeds $s & done; wait
    uv run python benchmarks/dapo_learning.py --steps 30 --analyze-only   # table + PNG

Each run is `rlflow train recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml` (45 warm-start steps, then
--prompts prompts x 8 generations per step, 8 new tokens at most) with --steps GRPO steps,
validation every 5 steps on the 64 held-out scenes, run.seed = 42, 43, 44. The recipe's own
budget is 150 steps of 16 prompts; the shared 2-core machine this ran on could not afford
9 such runs, hence the smaller defaults (benchmarks/dapo_learning.md says what ran). The
budget of a seed is the number of tokens plain GRPO generated in its --steps steps; every run
is scored by its last
validation at or under that budget (dynamic sampling generates extra rounds, so it reaches the
budget in fewer steps). Metrics of every run are kept in benchmarks/results/dapo/.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
OUT = ROOT / "benchmarks" / "results" / "dapo"
SEEDS = (42, 43, 44)
CONFIGS = {
    "grpo": [],
    "dynamic": ["grpo.dynamic_sampling.enabled=true"],
    "dynamic+overlong": [
        "grpo.dynamic_sampling.enabled=true",
        "loss.overlong_penalty.enabled=true",
        "loss.overlong_penalty.buffer_tokens=4",
        "loss.overlong_penalty.penalty=1.0",
    ],
}


def steps_for(config: str, seed: int, steps: int) -> int:
    """Plain GRPO runs `steps`. Dynamic sampling spends more tokens per step, so it reaches the
    same token budget sooner: it runs the steps plain GRPO's kept share of groups predicts
    (1 - its mean filtered fraction), plus 20% and rounded up to a validation step, to save
    compute on the 2-core machine. Runs that stop short of the budget are flagged in the table."""
    baseline = load("grpo", seed)
    if config == "grpo" or baseline is None:
        return steps
    train = [r for r in baseline if "train/filtered_fraction" in r]
    kept = 1 - statistics.mean(r["train/filtered_fraction"] for r in train)
    return min(steps, 5 * math.ceil(steps * kept * 1.2 / 5))


def run(config: str, seed: int, steps: int, prompts: int) -> None:
    dest = OUT / f"{config}-s{seed}.jsonl"
    if dest.exists():
        return
    steps = steps_for(config, seed, steps)
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            str(ROOT / ".venv" / "bin" / "rlflow"),
            "train",
            str(RECIPE),
            f"grpo.max_num_steps={steps}",
            f"grpo.num_prompts_per_step={prompts}",
            "grpo.val_period=5",
            f"run.seed={seed}",
            "grpo.dynamic_sampling.max_extra_rounds=8",
            "checkpointing.enabled=false",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            *CONFIGS[config],
            "--run-dir",
            tmp,
        ]
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            print(f"{config} seed {seed}: exit {result.returncode}\n{result.stderr[-2000:]}")
            (OUT / f"{config}-s{seed}.failed.txt").write_text(result.stderr[-5000:])
            return
        OUT.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "metrics.jsonl", dest)
        print(f"{config} seed {seed}: {seconds:.0f} s", flush=True)


STEPS = 10**9  # analysis cut-off (--steps): a longer saved run is read up to this step


def load(config: str, seed: int, partial: bool = False) -> list[dict] | None:
    """A finished run's metrics; with partial=True, else those of a run stopped part-way
    (`<config>-s<seed>.partial.jsonl`, copied from its run directory when time ran out)."""
    path = OUT / f"{config}-s{seed}.jsonl"
    if not path.exists() and partial:
        path = OUT / f"{config}-s{seed}.partial.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] <= STEPS]


def curve(records: list[dict]) -> list[tuple[float, int, float]]:
    """(cumulative generated tokens, step, val accuracy) at every validation."""
    tokens, points = 0.0, []
    for r in records:
        tokens += r.get("train/generated_tokens", 0.0)
        if "val/accuracy" in r:
            points.append((tokens, r["step"], r["val/accuracy"]))
    return points


def analyze() -> str:
    rows, curves = [], {}
    for config in CONFIGS:
        at_budget, final, filtered, steps_used, rounds, seeds = [], [], [], [], [], []
        for seed in SEEDS:
            records, baseline = load(config, seed, partial=True), load("grpo", seed)
            if records is None or baseline is None or len(curve(records)) < 2:
                continue
            budget = curve(baseline)[-1][0]
            points = curve(records)
            within = [p for p in points if p[0] <= budget * 1.0001]
            at_budget.append(within[-1][2])
            seeds.append(seed)
            finished = load(config, seed) is not None
            short = "" if points[-1][0] >= 0.9 * budget else " (short)"
            stopped = "" if finished else f", stopped at step {records[-1]['step']}"
            steps_used.append(f"{within[-1][1]}{short}{stopped}")
            final.append(points[-1][2])
            train = [r for r in records if "train/filtered_fraction" in r]
            filtered.append(statistics.mean(r["train/filtered_fraction"] for r in train))
            rounds.append(statistics.mean(r["train/extra_rounds"] for r in train))
            curves.setdefault(config, []).append(points)
        if at_budget:
            rows.append((config, seeds, at_budget, final, filtered, steps_used, rounds))
    lines = [
        "| run | val accuracy at the token budget, per seed | mean | step reached at "
        "budget | final val accuracy (own last step) | filtered fraction (mean over steps) | "
        "extra rounds / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for config, seeds, at_budget, final, filtered, steps_used, rounds in rows:
        lines.append(
            f"| {config} | {', '.join(f's{s} {a:.3f}' for s, a in zip(seeds, at_budget))} | "
            f"**{statistics.mean(at_budget):.3f}** | {', '.join(map(str, steps_used))} | "
            f"{statistics.mean(final):.3f} | {statistics.mean(filtered):.3f} | "
            f"{statistics.mean(rounds):.2f} |"
        )
    _plot(curves)
    return "\n".join(lines)


def _plot(curves: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = {"grpo": "tab:blue", "dynamic": "tab:orange", "dynamic+overlong": "tab:green"}
    for config, runs in curves.items():
        for i, points in enumerate(runs):
            ax.plot(
                [p[0] / 1000 for p in points],
                [p[2] for p in points],
                color=colours[config],
                alpha=0.75,
                linewidth=1.2,
                label=config if i == 0 else None,
            )
    ax.set_xlabel("generated tokens (thousands)")
    ax.set_ylabel("validation accuracy (greedy, 64 scenes)")
    ax.set_title("tiny CLEVR counting: GRPO vs DAPO dynamic sampling (one line per seed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT.parent / "dapo_learning.png", dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--analyze-only", action="store_true")
    args = parser.parse_args()
    global STEPS
    STEPS = args.steps  # the run is the same up to any step, whatever max_num_steps it had
    if not args.analyze_only:
        OUT.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            for config in args.configs:
                run(config, seed, args.steps, args.prompts)
    print(analyze())
    return 0


if __name__ == "__main__":
    sys.exit(main())
