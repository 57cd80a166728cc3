"""`rlflow status SWEEP_DIR` and `rlflow cancel SWEEP_DIR`: a sweep's elements, one line each.

States come from Slurm (squeue for live tasks, sacct for ended ones); step, reward and
validation accuracy from each element's RUN_DIR/metrics.jsonl. Standard library only (plus
the Slurm wrappers): this runs on login nodes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from rlflow import slurm
from rlflow.errors import EXIT_FINDINGS, Diagnostic, RlflowError
from rlflow.launch import sweep
from rlflow.launch.runfiles import RunFiles, read_run

_TASK = re.compile(r"^(\d+)_(\d+)$")  # one array task: ARRAY_INDEX
_TASKS = re.compile(r"^(\d+)_\[([^\]]+)\]$")  # pending tasks not yet split: ARRAY_[2-5%2]


def is_sweep_dir(text: str) -> bool:
    """A directory with a sweep.json (of whatever kind: read_manifest names what is wrong)."""
    return os.path.lexists(Path(text) / sweep.MANIFEST)


def task_states(array_id: str) -> dict[int, str]:
    """Array index -> Slurm state; squeue (live) wins over sacct (ended). An error when neither
    answered: "no task is known" must never be taken for "every task has ended"."""
    states: dict[int, str] = {}
    answers = slurm.array_task_lines(array_id)
    if all(lines is None for lines in answers):
        raise RlflowError(
            Diagnostic(
                "slurm.error",
                f"neither sacct nor squeue answered about job array {array_id}",
                help="is the controller reachable? `scontrol ping` says; SLURM_CONF picks the "
                "cluster",
            ),
            EXIT_FINDINGS,
        )
    for lines in answers:
        if lines is not None:
            states.update(_parse_states(lines, "|"))
    return states


def _parse_states(text: str, sep: str) -> dict[int, str]:
    states = {}
    for line in text.splitlines():
        job, _, state = line.strip().partition(sep)
        state = state.split()[0] if state.split() else "?"  # "CANCELLED by 1000"
        if match := _TASK.match(job):
            states[int(match[2])] = state
        elif match := _TASKS.match(job):
            for index in _expand(match[2].split("%")[0]):
                states[index] = state
    return states


def _expand(ranges: str) -> list[int]:
    """`0-3,5` -> [0, 1, 2, 3, 5] (Slurm's array index lists, steps `:2` included)."""
    found = []
    for part in ranges.split(","):
        span, _, step = part.partition(":")
        first, _, last = span.partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            found += range(int(first), int(last or first) + 1, int(step) if step.isdigit() else 1)
    return found


def describe(
    sweep_dir: Path, states: dict[int, str] | None = None, found: dict | None = None
) -> tuple[str, list[Diagnostic]]:
    """A header, then one line per element: state, step, last reward, validation accuracy; and
    the diagnostics of the elements' damaged files.

    states, found: the tasks' states and the manifest when the caller has just read them."""
    found = found or manifest(sweep_dir)
    array_id = found["array_job_id"]
    if states is None:
        states = task_states(array_id)
    rows = [["element", "job", "state", "step", "reward", "val acc"]]
    problems: list[Diagnostic] = []
    for element in found["elements"]:
        run = read_run(sweep_dir / element["name"])
        problems += run.problems
        step, reward, accuracy = _progress(run)
        rows.append(
            [
                element["name"],
                element["job_id"],
                states.get(element["index"], "UNKNOWN"),
                step,
                reward,
                accuracy,
            ]
        )
    counts: dict[str, int] = {}
    for row in rows[1:]:
        counts[row[2]] = counts.get(row[2], 0) + 1
    limit = found["max_concurrent"]
    axes = " x ".join(f"{a['key']} ({len(a['values'])})" for a in found["axes"])
    header = (
        f"sweep {sweep_dir.name}: job array {array_id}, {len(rows) - 1} elements ({axes})"
        + (f", at most {limit} at once" if limit else "")
        + ": "
        + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([header] + ["  " + line.rstrip() for line in lines]), problems


def _progress(run: RunFiles) -> tuple[str, str, str]:
    """(`step/max`, last train reward, `val accuracy @step`) from the element's metrics."""
    total = "?" if run.max_steps is None else str(run.max_steps)
    step = str(run.metrics[-1]["step"]) if run.metrics else "-"
    rewards = [r["train/reward"] for r in run.metrics if "train/reward" in r]
    validated = [r for r in run.metrics if "val/accuracy" in r]
    return (
        f"{step}/{total}",
        f"{rewards[-1]:.3f}" if rewards else "-",
        f"{validated[-1]['val/accuracy']:.3f} @{validated[-1]['step']}" if validated else "-",
    )


def cancel(sweep_dir: Path) -> str:
    """scancel the whole array; says what each element was doing. The manifest is read whole
    first (sweep.read_manifest): nothing is cancelled on a damaged or ambiguous one."""
    found = manifest(sweep_dir)
    array_id = found["array_job_id"]
    states = task_states(array_id)
    live = {i: s for i, s in states.items() if s not in slurm.FINAL_STATES}
    if not live:
        return f"sweep {sweep_dir.name} (job array {array_id}) has ended: nothing to cancel"
    result = slurm.cancel(array_id)
    if result.returncode != 0:
        raise slurm.failed(f"scancel could not cancel job array {array_id}", result)
    counts: dict[str, int] = {}
    for state in live.values():
        counts[state] = counts.get(state, 0) + 1
    ended = len(found["elements"]) - len(live)
    return (
        f"cancelled sweep {sweep_dir.name} (job array {array_id}): "
        + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        + f"; {ended} had already ended"
    )


def manifest(sweep_dir: Path) -> dict:
    """SWEEP_DIR/sweep.json, checked (sweep.read_manifest); an error where there is none."""
    found = sweep.read_manifest(sweep_dir)
    if found is None:
        raise RlflowError(
            Diagnostic(
                "sweep.not-a-sweep",
                f"{sweep_dir} has no {sweep.MANIFEST}",
                help="pass the directory `rlflow submit --sweep` printed",
            ),
            EXIT_FINDINGS,
        )
    return found


def element_dir(job_id: str, stdout: Path) -> Path | None:
    """The run directory of array task ARRAY_INDEX whose batch log is SWEEP_DIR/logs/..."""
    match = _TASK.match(job_id)
    if not match:
        return None
    try:
        found = sweep.read_manifest(stdout.parent.parent)
    except RlflowError:
        return None
    for element in (found or {}).get("elements", []):
        if element.get("job_id") == job_id:
            return stdout.parent.parent / element["name"]
    return None
