"""Wall time of `rlflow submit --dry-run` and `rlflow status`, the login-node commands.

Each sample is a fresh process, as a user runs it: the `rlflow` console script, the recipe
loaded and checked, the script rendered, `bash -n`, the pin check, the output printed. The
median of --runs samples is reported (wall and CPU time), with the physical floor beside it:
the interpreter's own start-up and `import click` (every subcommand needs click), and the load
average after each row (other work on the machine inflates wall time: compare on an idle one).

Each command runs twice over: with bytecode (the .pyc files of rlflow and its dependencies,
and the compiled sbatch template in ~/.cache/rlflow/templates, written by one run first) and
without (PYTHONPYCACHEPREFIX and XDG_CACHE_HOME pointing at empty directories, nothing
written: every module is compiled from source on every run, as in a fresh install without
`uv sync --compile-bytecode`).

    uv run python -m compileall -q .venv/lib rlflow   # once: uv installs no .pyc files
    uv run python benchmarks/submit_dry_run.py [--runs 15]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The console script users run; `python -m rlflow.cli` where it is not installed (a bare copy).
_SCRIPT = Path(sys.executable).parent / "rlflow"
RLFLOW = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "rlflow.cli"]
CASES = {
    "tests/launch/recipes/tiny-cpu.yaml --nodes 8 --gpus 4": [
        str(REPO / "tests/launch/recipes/tiny-cpu.yaml"),
        "--nodes",
        "8",
        "--gpus",
        "4",
    ],
    "recipes/vlm_grpo-qwen25vl-3b-clevr-4n8g-megatron-tp2.yaml --nodes 4 --gpus 8": [
        str(REPO / "recipes/vlm_grpo-qwen25vl-3b-clevr-4n8g-megatron-tp2.yaml"),
        "--nodes",
        "4",
        "--gpus",
        "8",
    ],
}


def sample(
    argv: list[str], cwd: Path, runs: int, env: dict[str, str]
) -> tuple[list[float], list[float]]:
    """Wall seconds and CPU seconds (user + system, the process and its children) per run.
    CPU time barely moves when other work shares the machine; wall time does."""
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        assert done.returncode == 0, done.stderr
    return walls, cpus


def row(name: str, where: str, mode: str, times: tuple[list[float], list[float]]) -> str:
    walls, cpus = times
    return (
        f"| {name} | {where} | {mode} | {statistics.median(walls) * 1000:.0f} | "
        f"{min(walls) * 1000:.0f} | {max(walls) * 1000:.0f} | {statistics.median(cpus) * 1000:.0f} "
        f"| {os.getloadavg()[0]:.1f} |"
    )


def commands(outside: Path) -> list[tuple[str, str, list[str], Path]]:
    """(name, where, argv, working directory) of every timed command."""
    rows = [
        ("python -c pass (interpreter start-up)", "-", [sys.executable, "-c", "pass"], REPO),
        ("python -c 'import click' (the floor)", "-", [sys.executable, "-c", "import click"], REPO),
        ("rlflow --help", "-", [*RLFLOW, "--help"], REPO),
    ]
    for name, args in CASES.items():
        argv = [*RLFLOW, "submit", *args, "--dry-run"]
        rows.append(
            (f"rlflow submit {name} --dry-run", "this repository (pin check runs)", argv, REPO)
        )
        rows.append(
            (f"rlflow submit {name} --dry-run", "outside git (no pin check)", argv, outside)
        )
    run = local_run(outside / "run")
    rows.append(
        (
            "rlflow status RUN_DIR",
            "a stopped local run, 500 steps",
            [*RLFLOW, "status", str(run)],
            REPO,
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    print(
        f"{runs} runs each; times in ms; rlflow = {' '.join(RLFLOW)}; "
        f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    print(
        "| command | working directory | bytecode | wall median | wall min | wall max | CPU median "
        "| load after |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as scratch:
        outside, empty = Path(scratch) / "outside", Path(scratch) / "empty"
        outside.mkdir()
        empty.mkdir()
        cached = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        bare = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        bare.update(PYTHONPYCACHEPREFIX=str(empty), XDG_CACHE_HOME=str(empty))
        for name, where, argv, cwd in commands(outside):
            subprocess.run(argv, cwd=cwd, capture_output=True, env=cached)  # writes what is missing
            for mode, env in (("yes", os.environ.copy()), ("no", bare)):
                print(row(name, where, mode, sample(argv, cwd, runs, env)), flush=True)
        assert not any(empty.iterdir()), "the no-bytecode runs wrote a cache"
        print(f"\nload average after: {os.getloadavg()[0]:.1f}")


def local_run(run: Path) -> Path:
    """A local run's directory (`rlflow train --nproc 2`) stopped after 500 steps: its launcher
    record, one attempt, a heartbeat, 500 metrics lines of the trainer's size (~1.5 kB)."""
    import json

    beat = run / "status" / "attempt-0" / "heartbeat" / "rank-0.json"
    beat.parent.mkdir(parents=True)
    beat.write_text(json.dumps({"phase": "training", "step": 500, "wall": time.time()}))
    record = {"format": 1, "pid": 1, "start_ticks": 0, "boot_id": "", "host": "elsewhere"}
    record.update(attempt=0, nproc=2, command=["rlflow", "train", "r.yaml"], cwd="/", started=0.0)
    (run / "launcher.json").write_text(json.dumps(record))
    (run / "attempts.jsonl").write_text(
        json.dumps(
            {"attempt": 0, "job_id": "", "outcome": "stopped", "reason": "saved and stopped",
             "nodes": "here", "excluded": [], "step": 500, "checkpoint_step": 500,
             "exit_code": 75, "action": "resume"}
        ) + "\n"
    )  # fmt: skip
    padding = {f"train/extra_{i}": 0.5 for i in range(60)}
    with open(run / "metrics.jsonl", "w") as out:
        for step in range(1, 501):
            line = {"step": step, "time/step": 2.0, "train/reward": 0.5, **padding}
            out.write(json.dumps(line) + "\n")
    (run / "recipe.resolved.yaml").write_text("grpo:\n  max_num_steps: 1000\n")
    return run


if __name__ == "__main__":
    main()
