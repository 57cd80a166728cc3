"""`rlflow submit --sweep`: check every element, then submit them all as one job array.

Each element is prepared exactly like a single submission (`prepare.prepare`: recipe rules,
flags, parallelism, sbatch values, paths, bash -n), in its own directory under SWEEP_DIR. One
bad element stops the sweep before anything is written. The array's script takes its #SBATCH
lines from the elements' own scripts, which must agree (a job array has one set of options).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import click

from rlflow.errors import EXIT_USAGE, Diagnostic, RlflowError
from rlflow.launch import cost, sweep
from rlflow.launch.prepare import Prepared, prepare, shape, unwritable_output

# Per element: its own run directory and batch log; everything else must be equal.
_OWN_SBATCH_LINES = ("#SBATCH --output=",)


@dataclass(frozen=True)
class PreparedSweep:
    sweep_dir: Path
    axes: list[sweep.Axis]
    elements: list[sweep.Element]
    prepared: list[Prepared]  # one per element, same order
    array: str  # sbatch --array value
    max_concurrent: int | None
    script: str  # the array's script
    warnings: list[Diagnostic]
    worst_total: float


def prepare_sweep(
    recipe: Path,
    overrides: tuple[str, ...],
    axes_text: tuple[str, ...],
    flags,
    *,
    max_concurrent: int | None,
    skip_pins: bool,
) -> PreparedSweep:
    """Every element prepared and checked, the array script rendered; raises on any problem."""
    from rlflow.launch.check import check_script_syntax
    from rlflow.launch.plan import run_dir_name
    from rlflow.launch.render import render_template
    from rlflow.recipe.load import load_recipe

    axes = sweep.parse_axes(axes_text, overrides)
    found = sweep.elements(axes)
    cwd, now, token = os.getcwd(), datetime.now(), secrets.token_hex(3)
    base = load_recipe(recipe, overrides).recipe.run  # the sweep's name and place
    sweep_dir = Path(cwd, base.output_dir, run_dir_name(base.name, now, token))
    prepared, problems, warnings, exit_codes = [], [], [], []
    for element in found:
        try:
            one = prepare(
                recipe,
                overrides + element.overrides,
                flags,
                skip_pins=skip_pins or element.index > 0,  # the same repository every time
                cwd=cwd,
                now=now,
                token=token,
                run_dir=str(sweep_dir / element.name),
            )
        except RlflowError as err:
            exit_codes.append(err.exit_code)  # 1 when only the pin check found drift, else 2
            problems += [d for d in err.diagnostics if d not in problems]
            problems.append(_element_error(element, "is not valid (above)"))
            continue
        warnings += [d for d in one.warnings if d not in warnings]
        prepared.append(one)
    if problems:
        raise RlflowError(warnings + problems, max(exit_codes))
    problems = _sbatch_lines_differ(found, prepared)
    if problems:
        raise RlflowError(problems, EXIT_USAGE)
    worst_total = sum(cost.worst_case(p.plan) for p in prepared)
    first = prepared[0]
    caps = [p for p in prepared if p.loaded.recipe.slurm.max_gpu_hours is not None]
    strictest = min(caps, key=lambda p: p.loaded.recipe.slurm.max_gpu_hours, default=first)
    cap_problems = cost.cap_problems(
        strictest.loaded,
        worst_total,
        f"this sweep of {len(found)} elements",
        notes=(
            f"each element: {cost.hours(first.plan.gpu_hours)} GPU-hours per attempt, up to "
            f"{cost.attempts_text(first.plan)}",
        ),
    )
    if cap_problems:
        raise RlflowError(cap_problems, EXIT_USAGE)
    array = sweep.array_spec(len(found), max_concurrent)
    script = render_template(
        "sweep.sh.j2",
        sbatch_lines=_array_sbatch_lines(first.script),
        array=array,
        batch_log=str(sweep_dir / "logs" / "slurm-").replace("%", "%%") + "%A_%a.out",
        element_dirs=[p.plan.run_dir for p in prepared],
    )
    syntax = check_script_syntax(script)
    if any(d.severity == "error" for d in syntax):
        raise RlflowError(syntax, EXIT_USAGE)
    return PreparedSweep(
        sweep_dir, axes, found, prepared, array, max_concurrent, script, warnings, worst_total
    )


def _element_error(element: sweep.Element, what: str) -> Diagnostic:
    return Diagnostic(
        "sweep.element",
        f"sweep element {element.index} ({', '.join(element.overrides)}) {what}; "
        "nothing was submitted",
        file="command line",
        help="fix or drop that value in its --sweep flag",
    )


def _sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH ")]


def _array_sbatch_lines(script: str) -> list[str]:
    return [line for line in _sbatch_lines(script) if not line.startswith(_OWN_SBATCH_LINES)]


def _sbatch_lines_differ(found: list[sweep.Element], prepared: list[Prepared]) -> list[Diagnostic]:
    first = _array_sbatch_lines(prepared[0].script)
    problems = []
    for element, one in zip(found[1:], prepared[1:], strict=True):
        lines = _array_sbatch_lines(one.script)
        if lines != first:
            theirs = next(iter([a for a in lines if a not in first] or lines), "")
            ours = next(iter([a for a in first if a not in lines] or first), "")
            problems.append(
                Diagnostic(
                    "sweep.sbatch-differs",
                    f"sweep element {element.index} ({', '.join(element.overrides)}) needs "
                    f"`{theirs}` where element 0 has `{ours}`: a job array has one set of sbatch "
                    "options; nothing was submitted",
                    file="command line",
                    help="sweep keys that leave the #SBATCH lines alone (not slurm.time_limit, "
                    "slurm.partition, ...), or submit those variants as separate jobs",
                )
            )
    return problems


# --- show and submit ---------------------------------------------------------------------------


def show_dry_run(swept: PreparedSweep) -> None:
    out = click.echo
    first = swept.prepared[0]
    out(f"# ---- script.sbatch (the job array; would be written to {swept.sweep_dir}) ----")
    out(swept.script, nl=False)
    out(f"# ---- element 0: {swept.elements[0].name}/script.sbatch (rendered) ----")
    out(first.script, nl=False)
    out(f"# ---- element 0: {swept.elements[0].name}/recipe.yaml (resolved) ----")
    out(_element_recipe(swept, 0), nl=False)
    out("# ---- sweep ----")
    out(_matrix(swept))
    out(_summary(swept))
    out(
        f"checks:     every element: recipe, flags vs cluster, parallelism fits "
        f"{first.plan.world_size} ranks, sbatch values, paths, bash -n; once (one repository): "
        f"{first.pins}; "
        "the array's #SBATCH lines agree"
        + (f", {len(swept.warnings)} warning(s) (above)" if swept.warnings else "")
    )
    if first.cluster is None:
        out("dry run: nothing submitted, no Slurm controller contacted")
    else:
        out(f"dry run: nothing submitted; checked against {first.cluster}")


def _matrix(swept: PreparedSweep) -> str:
    keys = [a.key for a in swept.axes]
    rows = [["#", "element", *keys, "worst GPU-h"]]
    for element, one in zip(swept.elements, swept.prepared, strict=True):
        values = [repr(v)[1:-1] if not v.isprintable() else v for v in _values(element)]
        worst = cost.hours(cost.worst_case(one.plan))
        rows.append([str(element.index), element.name, *values, worst])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(["matrix:"] + ["  " + line.rstrip() for line in lines])


def _values(element: sweep.Element) -> list[str]:
    return [override.partition("=")[2] for override in element.overrides]


def _summary(swept: PreparedSweep) -> str:
    plan = swept.prepared[0].plan
    count = len(swept.elements)
    once = sum(p.plan.gpu_hours for p in swept.prepared)
    at_once = f" (at most {swept.max_concurrent} at once)" if swept.max_concurrent else ""
    return "\n".join(
        [
            f"sweep dir:  {swept.sweep_dir}",
            f"job array:  {plan.job_name!r}: {count} elements, --array={swept.array}{at_once}; "
            f"each {shape(plan)}, time limit {plan.time_limit}",
            f"GPU-hours:  {cost.hours(once)} for the sweep ({count} x "
            f"{cost.hours(plan.gpu_hours)}, one attempt each)",
            f"worst case: {cost.hours(swept.worst_total)} for the sweep ({_attempts(swept)}); "
            f"{cost.cap_text(swept.prepared[0].loaded)}",
        ]
    )


def _attempts(swept: PreparedSweep) -> str:
    texts = {cost.attempts_text(p.plan) for p in swept.prepared}
    if len(texts) == 1:
        return f"each element {texts.pop()}"
    return "the elements' attempts differ: see the matrix"


def _element_recipe(swept: PreparedSweep, index: int) -> str:
    """The element's resolved recipe, under one comment line saying which element it is."""
    element = swept.elements[index]
    note = (
        f"# sweep element {element.index} of {len(swept.elements)} "
        f"({swept.sweep_dir.name}): {', '.join(element.overrides)}"
    )
    # One comment line, whatever the values hold.
    note = note.replace("\r", "\\r").replace("\n", "\\n")
    return note + "\n" + swept.prepared[index].recipe_text


def submit_sweep(swept: PreparedSweep) -> str:
    """Write SWEEP_DIR aside, sbatch the array on hold, move SWEEP_DIR into place, release."""
    from rlflow.job import files
    from rlflow.launch import rundir

    first = swept.prepared[0]
    staged = None
    try:
        staged = rundir.stage(str(swept.sweep_dir), {"script.sbatch": swept.script})
        git = rundir.git_json(first.plan.workdir)
        for index, (element, one) in enumerate(zip(swept.elements, swept.prepared, strict=True)):
            folder = staged.temp / element.name
            (folder / files.LOGS).mkdir(parents=True)
            (folder / "script.sbatch").write_text(one.script, encoding="utf-8")
            (folder / files.RECIPE).write_text(_element_recipe(swept, index), encoding="utf-8")
            (folder / "git.json").write_text(git, encoding="utf-8")
    except OSError as err:
        if staged is not None:
            staged.discard()
        raise unwritable_output(first.loaded, "sweep directory", swept.sweep_dir, err) from None

    def name_the_elements(array_id: str) -> None:
        for element in swept.elements:
            (staged.temp / element.name / files.JOB_ID).write_text(f"{array_id}_{element.index}\n")
        sweep.write_manifest(
            staged.temp, swept.axes, swept.elements, array_id, swept.max_concurrent
        )

    array_id, _ = rundir.submit_held(staged, "sweep", before_publish=name_the_elements)
    return array_id


def show_submitted(swept: PreparedSweep, array_id: str, parsable: bool) -> None:
    if parsable:
        click.echo(array_id)
        return
    plan = swept.prepared[0].plan
    once = sum(p.plan.gpu_hours for p in swept.prepared)
    click.echo(
        f"submitted sweep as job array {array_id} (--array={swept.array}): "
        f"{len(swept.elements)} elements, each {shape(plan)}, time limit {plan.time_limit} "
        f"({cost.hours(once)} GPU-hours; worst case {cost.hours(swept.worst_total)})"
    )
    click.echo(f"sweep dir: {swept.sweep_dir}")
    for element in swept.elements:
        click.echo(f"  {array_id}_{element.index}  {element.name}")
    click.echo(f"status:    rlflow status {swept.sweep_dir}")
