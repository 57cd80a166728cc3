"""Learning of the tiny Qwen3-VL-MoE CPU recipe (issue 18, item 9), router replay on and off.

    uv run python benchmarks/moe_learning.py --out /tmp/moe_learning        # both runs + table
    uv run python benchmarks/moe_learning.py --out /tmp/moe_learning --analyze-only

Each run is the shipped recipe, unchanged except for the replay key and the output directory:

    rlflow train recipes/tiny-qwen3vl-moe-clevr-1n1g-cpu.yaml \\
        run.output_dir=OUT/replay_{on,off} loss.router_replay={true,false}

(a 45-step supervised warm start, then 150 GRPO steps of 16 prompts x 8 generations, validation
every 25 steps on the 64 held-out scenes, run.seed 42). The runs go one after the other (the
machine has 2 shared cores). The table reads each run's RUN_DIR/metrics.jsonl: validation
accuracy at step 0 and at the last step, the best validation, and `moe/routing_agreement` (the
share of token x layer expert sets the trainer's first logprob pass chose as generation did,
before any replay), mean and minimum over the steps; wall time is the whole `rlflow train`
command, as measured by this script. Results: benchmarks/moe_learning.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny-qwen3vl-moe-clevr-1n1g-cpu.yaml"
RUN_NAME = "tiny-qwen3vl-moe-clevr-cpu"
REPLAY = {"on": "true", "off": "false"}


def train(out: Path, replay: str) -> float:
    """One `rlflow train` of the recipe; its wall time in seconds (also in OUT/wall_<replay>)."""
    cmd = [
        str(Path(sys.executable).with_name("rlflow")), "train", RECIPE,  # the console script
        f"run.output_dir={out / ('replay_' + replay)}", f"loss.router_replay={REPLAY[replay]}",
    ]  # fmt: skip
    start = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.monotonic() - start
    (out / f"wall_{replay}").write_text(f"{wall:.1f}\n")
    return wall


def summary(out: Path, replay: str) -> dict:
    rows = [json.loads(line) for line in (out / f"replay_{replay}" / RUN_NAME / "metrics.jsonl")
            .read_text().splitlines() if line.strip()]  # fmt: skip
    val = [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    agree = [r["moe/routing_agreement"] for r in rows if "moe/routing_agreement" in r]
    wall = out / f"wall_{replay}"
    return {
        "replay": replay,
        "steps": max(r["step"] for r in rows),
        "val_first": val[0],
        "val_last": val[-1],
        "val_best": max(v for _, v in val),
        "val_curve": val,
        "agreement_mean": sum(agree) / len(agree) if agree else None,
        "agreement_min": min(agree) if agree else None,
        "step_s": sum(r["time/step"] for r in rows if "time/step" in r)
        / max(1, sum("time/step" in r for r in rows)),
        "wall_s": float(wall.read_text()) if wall.exists() else None,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| router replay | GRPO steps | val acc step 0 | val acc last | best | routing agreement "
        "(mean / min) | mean step s | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        agree = "n/a" if r["agreement_mean"] is None else (
            f"{r['agreement_mean']:.4f} / {r['agreement_min']:.4f}")  # fmt: skip
        wall = "n/a" if r["wall_s"] is None else f"{r['wall_s']:.0f}"
        lines.append(
            f"| {r['replay']} | {r['steps']} | {r['val_first'][1]:.3f} | {r['val_last'][1]:.3f} "
            f"(step {r['val_last'][0]}) | {r['val_best']:.3f} | {agree} | {r['step_s']:.2f} | "
            f"{wall} |"
        )
    curves = [f"- replay {r['replay']}: " + ", ".join(f"{s}: {v:.3f}" for s, v in r["val_curve"])
              for r in results]  # fmt: skip
    return "\n".join(lines + ["", "Validation accuracy by step:"] + curves)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--analyze-only", action="store_true")
    parser.add_argument("--replay", choices=["on", "off", "both"], default="both")
    args = parser.parse_args()
    which = ["on", "off"] if args.replay == "both" else [args.replay]
    if not args.analyze_only:
        args.out.mkdir(parents=True, exist_ok=True)
        for replay in which:
            print(f"replay {replay}: {train(args.out, replay):.0f} s", flush=True)
    print(table([summary(args.out, r) for r in which]))


if __name__ == "__main__":
    main()
