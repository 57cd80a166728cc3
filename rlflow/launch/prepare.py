"""Recipe + flags -> checked plan + rendered script: everything `submit` does before Slurm.

Shared by a single submission (rlflow/launch/command.py) and by each element of a sweep
(rlflow/launch/sweep_submit.py), so both run the same rules. Nothing here writes a file or
submits a job; heavy modules are imported when `prepare` runs.
"""

from __future__ import annotations

import os
import secrets
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.errors import EXIT_FINDINGS, EXIT_USAGE, Diagnostic, RlflowError
from rlflow.frozen import frozen

if TYPE_CHECKING:  # types only: plan and load are imported when prepare runs
    from rlflow.launch.plan import JobPlan
    from rlflow.recipe.load import LoadedRecipe


@frozen
class Prepared:
    loaded: LoadedRecipe
    plan: JobPlan
    script: str
    recipe_text: str
    warnings: list[Diagnostic]
    pins: str  # how the pin check went, for the dry-run summary
    cluster: str | None = None  # what sinfo said about the partition; None: Slurm not asked


def prepare(
    recipe: Path,
    overrides: tuple[str, ...],
    flags,
    *,
    skip_pins: bool,
    cwd: str | None = None,
    now: datetime | None = None,
    token: str | None = None,
    run_dir: str | None = None,
) -> Prepared:
    """Everything up to the submission; raises with every problem found (nothing is written)."""
    from rlflow.launch import cost
    from rlflow.launch.check import check_all, check_cluster
    from rlflow.launch.plan import apply_flags, make_plan
    from rlflow.launch.render import render
    from rlflow.recipe.load import dump_recipe, load_recipe
    from rlflow.rules.checks import check_recipe

    cwd = cwd or os.getcwd()
    loaded = load_recipe(recipe, overrides)
    loaded, problems = apply_flags(loaded, flags)
    problems += check_recipe(loaded)
    _raise_on_errors(problems)
    plan = make_plan(
        loaded,
        flags,
        cwd=cwd,
        python=sys.executable,
        now=now or datetime.now(),
        token=token or secrets.token_hex(3),
        run_dir=run_dir,
    )
    script = render(plan)
    problems += check_all(
        loaded,
        plan,
        script,
        skip_pins=skip_pins,
        repo_root=Path(cwd),
        trains=flags.command is None,
    )
    cluster_problems, cluster = check_cluster(plan)
    problems += cluster_problems
    per_attempt = f"{plan.gpu_hours:.1f} GPU-hours per attempt, up to {cost.attempts_text(plan)}"
    problems += cost.cap_problems(loaded, cost.worst_case(plan), "this job", (per_attempt,))
    _raise_on_errors(problems)
    source = str(recipe).replace("\n", "\\n")  # one comment line, whatever the path holds
    recipe_text = f"# resolved by `rlflow submit` from {source}\n" + dump_recipe(loaded.data)
    return Prepared(
        loaded, plan, script, recipe_text, problems, _pins_summary(problems, skip_pins), cluster
    )


def _pins_summary(problems: list[Diagnostic], skipped: bool) -> str:
    if skipped:
        return "pins skipped (--skip-pin-check)"
    if any(p.category == "pins-unchecked" for p in problems):
        return "pins not checked (see the warning)"
    return "pins"


def _raise_on_errors(problems: list[Diagnostic]) -> None:
    """Exit 2 for unusable input (recipe, flags); exit 1 when only the pin check found drift."""
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        only_pins = all(p.category == "pins" for p in errors)
        raise RlflowError(problems, EXIT_FINDINGS if only_pins else EXIT_USAGE)


def shape(plan) -> str:
    """`2 nodes x 4 GPUs` (or CPU ranks), for the summaries of a job and of a sweep."""
    nodes, gpus = plan.num_nodes, plan.gpus_per_node
    unit = "GPU" if plan.gpu_request is not None else "CPU rank"
    return f"{nodes} node{'s' * (nodes != 1)} x {gpus} {unit}{'s' * (gpus != 1)}"


def unwritable_output(loaded, what: str, path: Path, err: OSError) -> RlflowError:
    """The error for a run (or sweep) directory that cannot be written: nothing was submitted."""
    return RlflowError(
        loaded.diagnostic(
            ("run", "output_dir"),
            "submit.output-dir",
            f"cannot write the {what} {path}: {err.strerror or err}",
            help="set run.output_dir to a directory you can write to; nothing was submitted",
        )
    )
