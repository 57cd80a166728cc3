"""TP=1 against TP=2 (with and without sequence parallelism): whole GRPO steps on the 3B shape.

Issue 22, part 1's target on two H200s: at TP=2, per-GPU tokens/s >= 75% of TP=1's and update
MFU >= 40%. This runs benchmarks/grpo_shaped.py (read its docstring for the workload: 64 prompts
x 8 samples of the Qwen2.5-VL-3B shape, bf16, random weights, seeded stop set) once per
variant, each in its own processes, and compares their step medians:

- tp1:      --tp 1 (one GPU; the other idles)
- tp2:      --tp 2, parallelism.sequence_parallel auto (= on at TP=2)
- tp2_nosp: --tp 2, parallelism.sequence_parallel=off

Writes OUT/<variant>/grpo_shaped_results.json (grpo_shaped.py's own file, per variant) and
OUT/tp_grpo.json: per variant and part, tokens/s/GPU, update and logprob MFU, seconds per
phase; per TP=2 variant the ratio of its tokens/s/GPU to TP=1's and whether each target holds.
Parts: `step` (the stop-set responses, mean ~80 tokens) and `fixed256` (every response 256
tokens, the long-response batch).

    # 2 H200s of one host; each variant alone fits one 10-minute device call
    PYTHONPATH=. python benchmarks/multi_gpu/tp_grpo.py --out $OUT --variants tp1
    PYTHONPATH=. python benchmarks/multi_gpu/tp_grpo.py --out $OUT --variants tp2
    PYTHONPATH=. python benchmarks/multi_gpu/tp_grpo.py --out $OUT --variants tp2_nosp
    # (tp_grpo.json compares whatever variants OUT holds, so the three calls add up)

    # CPU smoke test: tiny model, fp32, gloo, 4 prompts x 2 samples
    uv run python benchmarks/multi_gpu/tp_grpo.py --tiny --out /tmp/tp-grpo

The 7B shape at TP=2 (the issue's other run) needs a qwen25vl-7b preset in
rlflow/model/tiny.py, which does not exist yet; pass `--checkpoint DIR` of a 7B-shaped random
checkpoint to grpo_shaped.py by hand (`--extra "--checkpoint DIR"`) once it does.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHAPED = REPO / "benchmarks" / "grpo_shaped.py"
VARIANTS = {
    "tp1": ["--tp", "1"],
    "tp2": ["--tp", "2"],
    "tp2_nosp": ["--tp", "2", "--override", "parallelism.sequence_parallel=off"],
}
TARGET_RATIO = 0.75  # TP=2 tokens/s/GPU over TP=1's
TARGET_UPDATE_MFU = 0.40
KEYS = (
    "tokens_per_s_per_gpu",
    "update_mfu",
    "logprob_mfu",
    "time/step",
    "time/generation",
    "time/logprobs",
    "time/training",
)


def run_variant(name: str, args) -> int:
    command = [sys.executable, str(SHAPED), "--out", str(args.out / name), "--parts", args.parts]
    command += VARIANTS[name] + (["--tiny"] if args.tiny else []) + shlex.split(args.extra)
    print("+", shlex.join(command), flush=True)
    return subprocess.run(command, cwd=REPO).returncode


def summarise(out: Path) -> dict:
    """The step medians of every variant OUT holds, and the TP=2 ratios against TP=1."""
    found = {}
    for name in VARIANTS:
        path = out / name / "grpo_shaped_results.json"
        if not path.is_file():
            continue
        results = json.loads(path.read_text())["train"]
        found[name] = {
            part: {k: results[part]["median_of_steps_2_on"].get(k) for k in KEYS}
            for part in ("step", "fixed256")
            if part in results
        }
    compared = {}
    for name in ("tp2", "tp2_nosp"):
        for part, row in found.get(name, {}).items():
            base = found.get("tp1", {}).get(part)
            if not base or not base.get("tokens_per_s_per_gpu"):
                continue
            ratio = row["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            compared[f"{name}/{part}"] = {
                "tokens_per_s_per_gpu_ratio": ratio,
                "ratio_target": TARGET_RATIO,
                "ratio_met": ratio >= TARGET_RATIO,
                "update_mfu": row["update_mfu"],
                "update_mfu_target": TARGET_UPDATE_MFU,
                "update_mfu_met": (row["update_mfu"] or 0) >= TARGET_UPDATE_MFU,
            }
    return {"variants": found, "tp2_against_tp1": compared}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=",".join(VARIANTS))
    parser.add_argument("--parts", default="step,fixed256", help="grpo_shaped.py --parts")
    parser.add_argument("--tiny", action="store_true", help="tiny model, fp32: CPU smoke test")
    parser.add_argument("--extra", default="", help="more grpo_shaped.py arguments, one string")
    args = parser.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; use {','.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    codes = {name: run_variant(name, args) for name in names}
    summary = {"exit_codes": codes, "tiny": args.tiny, **summarise(args.out)}
    (args.out / "tp_grpo.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
