"""`rlflow submit`, `status`, `logs` and `cancel`.

submit: load the recipe -> fill it from the flags -> plan -> render -> check everything
(rlflow/launch/prepare.py) -> (--dry-run: print and stop) -> write the run directory aside ->
sbatch --hold -> rename the run directory into place -> release the job. Any failure on the way
submits nothing and leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from rlflow.errors import EXIT_FINDINGS, EXIT_OK, Diagnostic, RlflowError, print_diagnostics

if TYPE_CHECKING:  # submit's pipeline is imported when submit runs: status never needs it
    from rlflow.launch.prepare import Prepared

SUBMIT_EPILOG = """\b
Examples:
  rlflow submit recipes/vlm_grpo-qwen25vl-3b-clevr-4n8g-megatron-tp2.yaml --nodes 4 --gpus 8 --dry-run
  rlflow submit recipes/base.yaml grpo.num_prompts_per_step=32 --nodes 8 --gpus 4 --time 02:00:00
  rlflow submit recipes/base.yaml --nodes 1 --gpus 2 --command "python smoke.py --steps 3"
  rlflow submit recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml --nodes 1 --gpus 1 --after 1234

\b
Each rank runs `<slurm.rlflow_command> train RUN_DIR/recipe.yaml --run-dir RUN_DIR`, or the
--command given (split into words like a shell would, but not run through a shell: use
--command "bash -c '...'" for pipes or variables). Ranks get RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT. Before the time limit they get
slurm.stop_signal (SIGHUP by default; its name in RLFLOW_STOP_SIGNAL); a rank that saved and
stopped exits 75 and the job requeues itself (at most slurm.max_requeues times).
"""


@click.command(epilog=SUBMIT_EPILOG)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option(
    "--nodes",
    type=click.IntRange(min=1),
    required=True,
    help="Nodes to allocate (fills #SBATCH --nodes and cluster.num_nodes).",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    required=True,
    help="GPUs per node, one rank each (with slurm.request_gpus=false: ranks per node).",
)
@click.option(
    "--time",
    "time_limit",
    metavar="TIME",
    help="Time limit, overriding slurm.time_limit (e.g. 04:00:00).",
)
@click.option(
    "--after",
    multiple=True,
    metavar="JOBID",
    help="Start after this job has ended (repeatable); see --dependency-type.",
)
@click.option(
    "--dependency-type",
    default="afterok",
    show_default=True,
    type=click.Choice(["afterok", "afterany", "afternotok"]),
    help="What --after waits for: success, any end, or failure.",
)
@click.option(
    "--command",
    "rank_command",
    metavar="COMMAND",
    help="Run this command on every rank instead of `rlflow train` (smoke tests).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the script and the resolved recipe, run every check, submit nothing.",
)
@click.option(
    "--sweep",
    "sweeps",
    multiple=True,
    metavar="KEY=V1,V2",
    help="Sweep KEY over these values (repeatable): one job array over the cross product, "
    "each element in its own run directory under one sweep directory.",
)
@click.option(
    "--max-concurrent",
    type=click.IntRange(min=1),
    metavar="N",
    help="With --sweep: at most N elements run at once (the array's %N).",
)
@click.option("--skip-pin-check", is_flag=True, help="Submit even if check-pins finds drift.")
@click.option("--parsable", is_flag=True, help="Print only the job id.")
@click.pass_context
def submit(
    ctx: click.Context,
    recipe: str,
    overrides: tuple[str, ...],
    nodes: int,
    gpus: int,
    time_limit: str | None,
    after: tuple[str, ...],
    dependency_type: str,
    rank_command: str | None,
    dry_run: bool,
    sweeps: tuple[str, ...],
    max_concurrent: int | None,
    skip_pin_check: bool,
    parsable: bool,
) -> None:
    """Render a recipe to an sbatch script and submit it.

    RECIPE is a recipe file (recipes/*.yaml); OVERRIDES are dotted key=value pairs applied on
    top of it, e.g. grpo.max_num_steps=20.
    """
    from rlflow.launch.plan import SubmitFlags
    from rlflow.launch.prepare import prepare

    flags = SubmitFlags(
        nodes=nodes,
        gpus=gpus,
        time=time_limit,
        after=after,
        dependency_type=dependency_type,
        command=rank_command,
    )
    if sweeps or max_concurrent is not None:
        _submit_sweep(
            ctx, Path(recipe), overrides, sweeps, flags, max_concurrent, dry_run, parsable
        )
        return
    prepared = prepare(Path(recipe), overrides, flags, skip_pins=skip_pin_check)
    if prepared.warnings:
        print_diagnostics(prepared.warnings)
    if dry_run:
        show_dry_run(prepared)
        ctx.exit(EXIT_OK)
    job_id, run_dir = submit_prepared(prepared)
    show_submitted(prepared, job_id, run_dir, parsable)
    ctx.exit(EXIT_OK)


def _submit_sweep(ctx, recipe, overrides, sweeps, flags, max_concurrent, dry_run, parsable):
    """`submit --sweep`: every element checked, then one job array (rlflow/launch/sweep.py)."""
    from rlflow.launch import sweep_submit

    if not sweeps:
        raise RlflowError(
            Diagnostic(
                "sweep.axis",
                "`--max-concurrent` limits a sweep's job array, but no --sweep was given",
                file="command line",
                help="add --sweep KEY=V1,V2, or drop --max-concurrent",
            )
        )
    swept = sweep_submit.prepare_sweep(
        recipe,
        overrides,
        sweeps,
        flags,
        max_concurrent=max_concurrent,
        skip_pins=ctx.params["skip_pin_check"],
    )
    if swept.warnings:
        print_diagnostics(swept.warnings)
    if dry_run:
        sweep_submit.show_dry_run(swept)
        ctx.exit(EXIT_OK)
    sweep_submit.show_submitted(swept, sweep_submit.submit_sweep(swept), parsable)
    ctx.exit(EXIT_OK)


def show_dry_run(prepared: Prepared) -> None:
    plan = prepared.plan
    out = click.echo
    out(f"# ---- script.sbatch (rendered; would be written to {plan.run_dir}) ----")
    out(prepared.script, nl=False)
    out("# ---- recipe.yaml (resolved) ----")
    out(prepared.recipe_text, nl=False)
    out("# ---- summary ----")
    out(_summary(plan, prepared.loaded))
    warned = len(prepared.warnings)
    out(
        f"checks:     recipe, flags vs cluster, parallelism fits {plan.world_size} ranks, sbatch "
        f"values, paths, {prepared.pins}, bash -n: no errors"
        + (f", {warned} warning{'s' * (warned != 1)} (above)" if warned else "")
    )
    if prepared.cluster is None:
        out("dry run: nothing submitted, no Slurm controller contacted")
    else:
        out(f"dry run: nothing submitted; checked against {prepared.cluster}")


def _worst_case(plan) -> str:
    """`6.0 GPU-hours (6 attempts: the first + slurm.max_requeues 3 + ...)`."""
    from rlflow.launch import cost

    return f"{cost.hours(cost.worst_case(plan))} GPU-hours ({cost.attempts_text(plan)})"


def _summary(plan, loaded) -> str:
    from rlflow.launch import cost
    from rlflow.launch.prepare import shape
    from rlflow.rules.allocation import expert_layout
    from rlflow.rules.gym import gym_plan_text

    hours = plan.time_limit_seconds / 3600
    experts = expert_layout(loaded, plan.world_size)
    gym = gym_plan_text(loaded)
    return "\n".join(
        [
            f"run dir:    {plan.run_dir}",
            f"job:        {plan.job_name!r}: {shape(plan)} = {plan.world_size} "
            f"rank{'s' * (plan.world_size != 1)}, time limit {plan.time_limit}",
            f"GPU-hours:  {plan.gpu_hours:.1f} ({shape(plan)} x {hours:.2f} h) per attempt",
            f"worst case: {_worst_case(plan)}; {cost.cap_text(loaded)}",
            f"each rank:  {' '.join(plan.rank_command)}",
            *([f"placement:  {plan.placement}"] if plan.placement else []),
            *([f"experts:    {experts}"] if experts else []),
            *([f"gym:        {gym}"] if gym else []),
        ]
    )


def submit_prepared(prepared: Prepared) -> tuple[str, Path]:
    """Write the run directory aside, sbatch it on hold, rename it into place, release the job."""
    from rlflow.launch import rundir
    from rlflow.launch.prepare import unwritable_output

    plan = prepared.plan
    files = {
        "script.sbatch": prepared.script,
        "recipe.yaml": prepared.recipe_text,
        "git.json": rundir.git_json(plan.workdir),
    }
    try:
        staged = rundir.stage(plan.run_dir, files)
    except OSError as err:
        raise unwritable_output(prepared.loaded, "run directory", plan.run_dir, err) from None
    return rundir.submit_held(staged, "run")


def show_submitted(prepared: Prepared, job_id: str, run_dir: Path, parsable: bool) -> None:
    from rlflow.launch.prepare import shape

    if parsable:
        click.echo(job_id)
        return
    plan = prepared.plan
    click.echo(
        f"submitted job {job_id}: {shape(plan)}, time limit {plan.time_limit} "
        f"({plan.gpu_hours:.1f} GPU-hours; worst case {_worst_case(plan)})"
    )
    click.echo(f"run dir: {run_dir}")
    from rlflow.job.files import LOGS, rank_log

    click.echo(f"logs:    {rank_log(run_dir / LOGS, 0)}   (rlflow logs {job_id} --follow)")


# --- status, logs, cancel ----------------------------------------------------------------------

JOB_HELP = "JOB is a job id or a run directory (which holds the job id)."


@click.command(
    epilog="\b\nExamples:\n  rlflow status 1234\n  rlflow status runs/clevr-20260101-120000-a1b2c3"
    "\n  rlflow status 1234 --watch --interval 5"
    "\n  rlflow status runs/try --watch            (a local run: rlflow train --run-dir runs/try)"
)
@click.argument("job")
@click.option(
    "--watch",
    "-w",
    is_flag=True,
    help="A live screen (queue, phase and step, speed, ETA, attempts, last error), redrawn until "
    "the job ends (exit 0 if it completed) or Ctrl-C (exit 130).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.2),
    default=2.0,
    show_default=True,
    help="Seconds between redraws with --watch.",
)
@click.pass_context
def status(ctx: click.Context, job: str, watch: bool, interval: float) -> None:
    """Show the state of a job, a local run, or every element of a sweep.

    JOB is a job id, a run directory (a submitted job's, or a local run's: `rlflow train
    --run-dir DIR --nproc N`), or a sweep directory (one line per element: state, step, last
    reward, validation accuracy). A damaged file in the directory is named after what could be
    read, with exit 2.
    """
    from rlflow.launch import jobs, sweep_jobs

    if sweep_jobs.is_sweep_dir(job):
        if watch:
            from rlflow.launch import monitor

            ctx.exit(monitor.watch_sweep(Path(job), interval))
        _show(*sweep_jobs.describe(Path(job)))  # one line per element
        ctx.exit(EXIT_OK)
    ref = jobs.resolve(job)
    if watch:
        from rlflow.launch import monitor

        if ref.local:
            from rlflow.launch import local

            ctx.exit(local.watch_local(ref.run_dir, interval))
        ctx.exit(monitor.watch(ref.job_id, ref.run_dir, interval))
    _show(*jobs.describe(ref))
    ctx.exit(EXIT_OK)


def _show(text: str, problems: list[Diagnostic]) -> None:
    """What could be read, then the damaged files (exit 2)."""
    click.echo(text)
    if problems:
        raise RlflowError(problems)


@click.command(
    epilog="\b\nExamples:\n  rlflow logs 1234 --follow\n  rlflow logs 1234 --rank 3\n"
    "  rlflow logs 1234 --batch\n  rlflow logs runs/try --follow              (a local run)"
)
@click.argument("job")
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Keep printing as the log grows, until the job ends (exit 0 if it completed).",
)
@click.option(
    "--rank", type=click.IntRange(min=0), default=0, show_default=True, help="Whose log to print."
)
@click.option(
    "--batch", is_flag=True, help="Print the batch script's log (slurm-<job>.out) instead."
)
@click.pass_context
def logs(ctx: click.Context, job: str, follow: bool, rank: int, batch: bool) -> None:
    """Print (or follow) a job's training log.

    JOB is a job id or a run directory (a submitted job's, or a local run's).
    """
    from rlflow.launch import jobs

    ref = jobs.resolve(job)
    path = jobs.log_path(ref, rank=rank, batch=batch)
    if not follow:
        jobs.print_log(path)
        ctx.exit(EXIT_OK)
    ctx.exit(EXIT_OK if jobs.follow(path, ref) else EXIT_FINDINGS)


@click.command(
    epilog="\b\nExamples:\n  rlflow cancel 1234\n  rlflow cancel runs/clevr-20260101-120000-a1b2c3"
    "\n  rlflow cancel 1234_3                      (element 3 of a sweep)"
    "\n  rlflow cancel runs/clevr-20260101-120000-a1b2c3   (a sweep directory: every element)"
    "\n  rlflow cancel runs/try                    (a local run: saves and stops)"
)
@click.argument("job")
@click.pass_context
def cancel(ctx: click.Context, job: str) -> None:
    """Cancel a submitted job, a sweep element, a whole sweep, or stop a local run.

    JOB is a job id (ARRAY_INDEX for one sweep element), a run directory (a job's, a sweep
    element's, or a local run's: its launcher gets SIGTERM, and the ranks save and stop), or a
    sweep directory (every element). Nothing is cancelled unless the directory's job id (or
    sweep.json) was read whole and unambiguous.
    """
    from rlflow.launch import jobs, sweep_jobs

    if sweep_jobs.is_sweep_dir(job):
        click.echo(sweep_jobs.cancel(Path(job)))  # the whole job array
        ctx.exit(EXIT_OK)
    ref = jobs.resolve(job)
    click.echo(jobs.cancel(ref))
    ctx.exit(EXIT_OK)
