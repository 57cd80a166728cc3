"""Run every shipped tiny recipe as shipped, for a few steps, and record how each one ended.

Each recipe in recipes/tiny-*.yaml runs as a user runs it, `rlflow train RECIPE ... --nproc 1`
through the console script, with only the overrides that shorten it: GRPO steps, warm-start
steps, and validation (once, at the end, on a few samples). Nothing else changes, so model
dtype, CUDA graphs, decode compilation and checkpointing are the recipe's own: a recipe that
fails here fails for its users. On a GPU machine the run uses the GPU (the trainer's own choice).

    python benchmarks/smoke_recipes.py --out DIR [--steps 3] [--only qwen3-moe,qwen3vl-moe]

writes DIR/smoke_recipes.json, DIR/smoke_recipes.md (recipe, exit code, seconds, last line or
error) and DIR/<recipe>.log; the run directories go under --work (/tmp/rlflow-smoke). Where
rlflow is not installed (PYTHONPATH only, as on the GPU machine of benchmarks/smoke_recipes.md),
the script writes the console script pip would (`from rlflow.cli import main`) into the --work
folder and runs that. Once the record is kept,

    python benchmarks/smoke_recipes.py --stamp DIR/smoke_recipes.json [MORE.json ...]

writes each recipe's "# Last run as shipped:" header line from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAMP = "# Last run as shipped:"
# What shortens a run and changes nothing else (each key exists in recipes/base.yaml).
SHORTEN = [
    "grpo.val_at_start=false",
    "grpo.val_period=0",  # validate once, at the end
    "grpo.max_val_samples=8",
]
ERROR = re.compile(r"(^error\b|Error\b|Exception\b|Traceback|exited with code|timed out)", re.I)


def recipes(only: str) -> list[Path]:
    found = sorted((ROOT / "recipes").glob("tiny-*.yaml"))
    wanted = [w for w in only.split(",") if w]
    return [r for r in found if not wanted or any(w in r.stem for w in wanted)]


def console_script(work: Path) -> str:
    """The `rlflow` console script on PATH, or the one pip would write, in work/bin."""
    installed = shutil.which("rlflow")
    if installed:
        return installed
    script = work / "bin" / "rlflow"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom rlflow.cli import main\nsys.exit(main())\n"
    )
    script.chmod(0o755)
    return str(script)


def device() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        names = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        names = []
    names = [n.strip() for n in names if n.strip()]
    return f"1x {names[0]}" if names else "CPU"


def outcome(log: str, rc: int | None) -> str:
    """The line that says how the run ended: its last line, or its error where it failed."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    if rc != 0:
        errors = [line for line in lines if ERROR.search(line)]
        if errors:
            return errors[-1][:300]
    return lines[-1][:300] if lines else ""


def run_one(recipe: Path, rlflow: str, args) -> dict:
    from rlflow.recipe.load import load_recipe

    run_dir = args.work / "runs" / recipe.stem
    warm_start = load_recipe(recipe, []).recipe.warm_start.num_steps  # shortened, never added
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [
        rlflow,
        "train",
        str(recipe.relative_to(ROOT)),
        f"grpo.max_num_steps={args.steps}",
        f"warm_start.num_steps={min(warm_start, args.warm_start_steps)}",
        *SHORTEN,
        "--run-dir",
        str(run_dir),
        "--nproc",
        "1",
    ]
    log_path = args.out / f"{recipe.stem}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # a timeout ends the launcher and its rank together
        )
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
            log.write(f"timed out after {args.timeout} s\n")
    seconds = round(time.perf_counter() - start, 1)
    if rc != 0:  # the ranks' own logs too: a rank's error may not reach the launcher's output
        with open(log_path, "a") as log:
            for rank_log in sorted((run_dir / "logs").glob("*.log")):
                log.write(f"\n--- {rank_log.name}\n{rank_log.read_text(errors='replace')[-20000:]}")
    text = log_path.read_text(errors="replace")
    result = {
        "recipe": recipe.name,
        "rc": rc,
        "seconds": seconds,
        "line": outcome(text, rc),
        "command": " ".join(command[1:]),
    }
    print(json.dumps(result), flush=True)
    return result


def table(record: dict) -> str:
    rows = [
        f"Device: {record['device']}; {record['steps']} GRPO steps, "
        f"{record['warm_start_steps']} warm-start steps; {record['date']}.",
        "",
        "| recipe | rc | seconds | last line / error |",
        "| --- | --- | --- | --- |",
    ]
    for r in record["results"]:
        line = r["line"].replace("|", "\\|")
        rc = "timeout" if r["rc"] is None else r["rc"]
        rows.append(f"| {r['recipe']} | {rc} | {r['seconds']} | `{line}` |")
    return "\n".join(rows) + "\n"


def stamp(results: list[Path]) -> None:
    """Write each recorded recipe's "# Last run as shipped:" line (replacing an older one) as
    the last line of its header comment."""
    for results_json in results:
        record = json.loads(results_json.read_text())
        for r in record["results"]:
            _stamp_one(record, r)


def _stamp_one(record: dict, r: dict) -> None:
    path = ROOT / "recipes" / r["recipe"]
    verdict = "passed" if r["rc"] == 0 else f"FAILED ({r['line'][:80]})"
    line = (
        f"{STAMP} {record['date']} on {record['device']}, {record['steps']} GRPO steps "
        f"(benchmarks/smoke_recipes.py): {verdict}"
    )
    lines = [x for x in path.read_text().splitlines() if not x.startswith(STAMP)]
    header = next(i for i, x in enumerate(lines) if not x.startswith("#"))
    lines.insert(header, line)
    path.write_text("\n".join(lines) + "\n")
    print(path.relative_to(ROOT), "->", line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="where the table and the logs go")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per recipe")
    parser.add_argument("--warm-start-steps", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per recipe")
    parser.add_argument("--only", default="", help="comma-separated parts of recipe names")
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/rlflow-smoke"), help="run directories go here"
    )
    parser.add_argument(
        "--stamp", type=Path, nargs="+", help="smoke_recipes.json files: stamp the recipes"
    )
    args = parser.parse_args()
    if args.stamp:
        return stamp(args.stamp)
    if args.out is None:
        parser.error("--out is required (or --stamp RESULTS_JSON)")
    out = args.out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.work = args.work.resolve()
    rlflow = console_script(args.work)
    record = {
        "device": device(),
        "date": datetime.date.today().isoformat(),
        "steps": args.steps,
        "warm_start_steps": args.warm_start_steps,
        "results": [run_one(recipe, rlflow, args) for recipe in recipes(args.only)],
    }
    (out / "smoke_recipes.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "smoke_recipes.md").write_text(table(record))
    print(table(record))
    sys.exit(0 if all(r["rc"] == 0 for r in record["results"]) else 1)


if __name__ == "__main__":
    main()
