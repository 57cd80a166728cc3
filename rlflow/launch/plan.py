"""Recipe + submit flags -> JobPlan: every value the sbatch script needs, computed once.

`--nodes` and `--gpus` are the single source of truth for the job's shape: they fill the
#SBATCH lines, the ranks the node launcher starts, and the recipe's `cluster` section. A recipe
that says otherwise is an error here, before anything is rendered or submitted.

Pure: the clock, the random token, the working directory and the interpreter are arguments,
so the same inputs always give the same plan (the golden tests rely on it).
"""

from __future__ import annotations

import os
import re
import shlex
from datetime import datetime

from rlflow.errors import Diagnostic
from rlflow.frozen import frozen
from rlflow.job import files
from rlflow.recipe.load import LoadedRecipe, Origin, with_values
from rlflow.recipe.scalars import parse_time_limit

# Rendezvous ports stay below 9000: on some clusters the ephemeral range starts there, and a
# port derived from the job id keeps two jobs sharing a node from colliding (NeMo-RL's plan).
MASTER_PORT_BASE = 1400
MASTER_PORT_SPAN = 600
DEPENDENCY_TYPES = ("afterok", "afterany", "afternotok")
_JOB_ID = re.compile(r"^\d+(_\d+)?$")


@frozen
class SbatchOption:
    """An #SBATCH option rlflow sets. It and its `spellings` (short forms, and options that would
    clash with it) are refused in slurm.extra_sbatch_args, where a second copy would silently
    win or clash; the error names `source`, what sets it instead."""

    option: str  # "--partition"
    source: str  # "slurm.partition": the recipe key it copies, or what else sets it ("--nodes")
    spellings: tuple[str, ...] = ()  # "-p"
    from_recipe: bool = False  # the value is slurm.<key>'s (left out when null), not computed

    @property
    def recipe_key(self) -> str:
        return self.source.removeprefix("slurm.")


# The #SBATCH lines in order: the template loops over JobPlan.sbatch_options, built from this
# table, and check.py derives the options it refuses in slurm.extra_sbatch_args from it. A new
# option the recipe passes through is a field in the schema's `slurm` section, its default in
# recipes/base.yaml and one row here with from_recipe=True.
SBATCH_OPTIONS = (
    SbatchOption("--job-name", "run.name", ("-J",)),
    SbatchOption("--nodes", "--nodes", ("-N",)),
    SbatchOption("--ntasks-per-node", "--nodes", ("-n", "--ntasks")),
    SbatchOption("--gpus-per-node", "--gpus", ("--gpus", "-G", "--gres")),
    SbatchOption("--time", "--time", ("-t",)),
    SbatchOption("--chdir", "the submit directory", ("-D",)),
    SbatchOption("--output", "run.output_dir", ("-o", "-e", "--error")),
    SbatchOption("--open-mode", "run.output_dir"),
    SbatchOption("--signal", "slurm.signal_grace_seconds"),
    SbatchOption("--requeue", "slurm.max_requeues"),
    SbatchOption("--no-requeue", "slurm.max_requeues"),
    SbatchOption("--partition", "slurm.partition", ("-p",), from_recipe=True),
    SbatchOption("--account", "slurm.account", ("-A",), from_recipe=True),
    SbatchOption("--qos", "slurm.qos", ("-q",), from_recipe=True),
    SbatchOption("--cpus-per-task", "slurm.cpus_per_task", ("-c",), from_recipe=True),
    SbatchOption("--mem", "slurm.mem", from_recipe=True),
    SbatchOption("--dependency", "--after", ("-d",)),
)


@frozen
class SubmitFlags:
    """The command-line half of a submission (the recipe is the other half)."""

    nodes: int
    gpus: int  # GPUs per node; on CPU-only nodes, ranks per node
    time: str | None = None  # overrides slurm.time_limit
    after: tuple[str, ...] = ()  # job ids this job waits for
    dependency_type: str = "afterok"
    command: str | None = None  # a custom per-rank command instead of `rlflow train`


@frozen
class JobPlan:
    """Everything the template places. Strings and numbers only; the template computes nothing."""

    job_name: str
    num_nodes: int
    gpus_per_node: int  # ranks per node
    gpu_request: str | None  # "--gpus-per-node=G", or None on CPU-only clusters
    world_size: int
    time_limit: str
    time_limit_seconds: int
    gpu_hours: float
    # (option, value) per #SBATCH line from SBATCH_OPTIONS: `option=value`, or the option alone
    # where the value is None; e.g. ("--partition", "batch"), ("--requeue", None)
    sbatch_options: tuple[tuple[str, str | None], ...]
    partition: str | None
    cpus_per_task: int | None
    extra_sbatch_args: tuple[str, ...]
    signal_grace_seconds: int
    max_requeues: int
    max_failure_retries: int
    stop_signal: str  # the time-limit warning as the ranks hear it (USR1 or HUP)
    startup_timeout_seconds: int | None  # watchdog: a rank's first progress report (rlflow train)
    container_image: str | None
    container_mounts: str | None  # pyxis' comma-separated list
    apptainer: tuple[str, ...] | None  # `apptainer exec ... IMAGE`, the words before each step
    env: tuple[tuple[str, str], ...]
    setup_command: str | None
    workdir: str  # the job runs here (the directory `rlflow submit` ran in)
    run_dir: str
    log_dir: str
    python: str  # the interpreter that runs the node launcher
    rank_command: tuple[str, ...]
    master_port_base: int
    master_port_span: int
    # generation.placement separate: which ranks train and which generate (logged, and shown
    # by the dry run); None when every rank does both
    placement: str | None = None


def apply_flags(loaded: LoadedRecipe, flags: SubmitFlags) -> tuple[LoadedRecipe, list[Diagnostic]]:
    """The recipe with `cluster` (and `slurm.time_limit` for --time) filled from the flags.

    A recipe that sets `cluster.*` to something else than the flags is an error: two sources
    for the job's shape is how jobs end up waiting for ranks that were never started. Returns
    the problems instead of raising, so that one run reports them with the recipe's own.
    """
    conflicts = _cluster_conflicts(loaded, flags)
    problems = conflicts + _flag_problems(flags)
    filled = loaded
    if not conflicts:
        filled = with_values(
            filled,
            {("cluster", "num_nodes"): flags.nodes, ("cluster", "gpus_per_node"): flags.gpus},
            Origin(f"submit --nodes {flags.nodes} --gpus {flags.gpus}"),
        )
    if flags.time is not None and parse_time_limit(flags.time):
        filled = with_values(
            filled, {("slurm", "time_limit"): flags.time}, Origin(f"submit --time {flags.time}")
        )
    return filled, problems


def make_plan(
    loaded: LoadedRecipe,
    flags: SubmitFlags,
    *,
    cwd: str,
    python: str,
    now: datetime,
    token: str,
    run_dir: str | None = None,
) -> JobPlan:
    """The job's plan; `loaded` must already carry the flags (see `apply_flags`). `run_dir`
    places it (a sweep's element directory); by default it is a new one under run.output_dir."""
    recipe = loaded.recipe
    slurm = recipe.slurm
    run_dir = run_dir or _run_dir(recipe.run.output_dir, recipe.run.name, cwd, now, token)
    log_dir = os.path.join(run_dir, files.LOGS)
    seconds = parse_time_limit(slurm.time_limit)
    assert seconds is not None, "check_recipe validates slurm.time_limit before planning"
    pyxis = slurm.container.runtime == "pyxis"
    # sbatch --output pattern (%j = job id; a literal % is escaped)
    batch_log = os.path.join(log_dir, "slurm-").replace("%", "%%") + "%j.out"
    requeue = slurm.max_requeues > 0 or slurm.max_failure_retries > 0
    computed = {
        "--job-name": recipe.run.name,
        "--nodes": flags.nodes,
        "--ntasks-per-node": 1,
        "--gpus-per-node": flags.gpus if slurm.request_gpus else None,
        "--time": slurm.time_limit,
        "--chdir": cwd,
        "--output": batch_log,
        "--open-mode": "append",
        "--signal": f"B:USR1@{slurm.signal_grace_seconds}",
        "--requeue": True if requeue else None,
        "--no-requeue": None if requeue else True,
        "--dependency": f"{flags.dependency_type}:{':'.join(flags.after)}" if flags.after else None,
    }
    return JobPlan(
        job_name=recipe.run.name,
        num_nodes=flags.nodes,
        gpus_per_node=flags.gpus,
        gpu_request=f"--gpus-per-node={flags.gpus}" if slurm.request_gpus else None,
        world_size=flags.nodes * flags.gpus,
        time_limit=slurm.time_limit,
        time_limit_seconds=seconds,
        gpu_hours=flags.nodes * flags.gpus * seconds / 3600 if slurm.request_gpus else 0.0,
        sbatch_options=sbatch_options(slurm, computed),
        partition=slurm.partition,
        cpus_per_task=slurm.cpus_per_task,
        extra_sbatch_args=tuple(slurm.extra_sbatch_args),
        signal_grace_seconds=slurm.signal_grace_seconds,
        max_requeues=slurm.max_requeues,
        max_failure_retries=slurm.max_failure_retries,
        stop_signal=slurm.stop_signal,
        # A --command need not report progress; `rlflow train` does from its first second.
        startup_timeout_seconds=(
            recipe.watchdog.startup_timeout_s
            if recipe.watchdog.enabled and flags.command is None
            else None
        ),
        container_image=slurm.container_image if pyxis else None,
        container_mounts=(
            ",".join(slurm.container_mounts) if pyxis and slurm.container_mounts else None
        ),
        apptainer=(  # no image: check_recipe reports it before anything is planned
            _apptainer_words(slurm)
            if slurm.container.runtime == "apptainer" and slurm.container_image
            else None
        ),
        env=tuple(slurm.env.items()),
        setup_command=slurm.setup_command,
        workdir=cwd,
        run_dir=run_dir,
        log_dir=log_dir,
        python=python,
        rank_command=_rank_command(slurm.rlflow_command, flags.command, run_dir),
        master_port_base=MASTER_PORT_BASE,
        master_port_span=MASTER_PORT_SPAN,
        placement=_placement(loaded, flags),
    )


def _placement(loaded: LoadedRecipe, flags: SubmitFlags) -> str | None:
    from rlflow.rules.allocation import placement_of

    if flags.command is not None:
        return None
    placement = placement_of(loaded.recipe, flags.nodes, flags.gpus)
    return placement.describe() if placement.separate else None


def sbatch_options(slurm, computed: dict[str, object]) -> tuple[tuple[str, str | None], ...]:
    """SBATCH_OPTIONS with their values: slurm.<key>'s for the recipe's options, `computed`'s for
    the rest; an option whose value is None is left out, one whose value is True is a flag."""
    lines = []
    for row in SBATCH_OPTIONS:
        value = getattr(slurm, row.recipe_key) if row.from_recipe else computed[row.option]
        if value is not None:
            lines.append((row.option, None if value is True else str(value)))
    return tuple(lines)


def recipe_sbatch_values(slurm) -> list[tuple[str, str]]:
    """(recipe key, value) of the set string options the recipe passes through to #SBATCH."""
    values = [
        (row.source, getattr(slurm, row.recipe_key)) for row in SBATCH_OPTIONS if row.from_recipe
    ]
    return [(key, value) for key, value in values if isinstance(value, str)]


def _apptainer_words(slurm) -> tuple[str, ...]:
    """`apptainer exec [--nv] --bind=M ... [ARGS] IMAGE`: every srun step runs inside it. --nv
    maps the node's NVIDIA driver and GPUs in (not on CPU-only clusters)."""
    return (
        *shlex.split(slurm.container.apptainer_command),
        "exec",
        *(("--nv",) if slurm.request_gpus else ()),
        *(f"--bind={mount}" for mount in slurm.container_mounts),
        *slurm.container.apptainer_args,
        slurm.container_image,
    )


def run_dir_name(name: str, now: datetime, token: str) -> str:
    """`{run.name}-{YYYYmmdd-HHMMSS}-{token}`, with characters unsafe in a file name replaced."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "run"
    return f"{safe}-{now:%Y%m%d-%H%M%S}-{token}"


def _run_dir(output_dir: str, name: str, cwd: str, now: datetime, token: str) -> str:
    return os.path.join(cwd, output_dir, run_dir_name(name, now, token))


def _rank_command(rlflow_command: str, custom: str | None, run_dir: str) -> tuple[str, ...]:
    """What every rank runs: `rlflow train RUN_DIR/recipe.yaml --run-dir RUN_DIR` by default."""
    if custom is not None:
        return tuple(shlex.split(custom))
    recipe = os.path.join(run_dir, files.RECIPE)
    return (*shlex.split(rlflow_command), "train", recipe, "--run-dir", run_dir)


def _cluster_conflicts(loaded: LoadedRecipe, flags: SubmitFlags) -> list[Diagnostic]:
    cluster = loaded.recipe.cluster
    problems = []
    for key, flag, wanted in (
        ("num_nodes", "--nodes", flags.nodes),
        ("gpus_per_node", "--gpus", flags.gpus),
    ):
        value = getattr(cluster, key)
        if value is not None and value != wanted:
            problems.append(
                loaded.diagnostic(
                    ("cluster", key),
                    "submit.cluster-conflict",
                    f"`cluster.{key}` is {value} in the recipe, but `{flag} {wanted}` was given",
                    help=f"`{flag}` decides the job's shape: remove `cluster.{key}` from the recipe "
                    f"(submit fills it in), or pass `{flag} {value}`",
                )
            )
    return problems


def _flag_problems(flags: SubmitFlags) -> list[Diagnostic]:
    problems = []
    if flags.time is not None and not parse_time_limit(flags.time):
        problems.append(
            _flag_error(
                "submit.time",
                f"`--time {flags.time}` is not a Slurm time limit",
                "use minutes, MM:SS, HH:MM:SS or D-HH:MM:SS, e.g. --time 04:00:00",
            )
        )
    for job in flags.after:
        if not _JOB_ID.match(job):
            problems.append(
                _flag_error(
                    "submit.after",
                    f"`--after {job}` is not a job id",
                    "pass the number `rlflow submit` printed, e.g. --after 1234",
                )
            )
    if flags.dependency_type not in DEPENDENCY_TYPES:
        problems.append(
            _flag_error(
                "submit.dependency-type",
                f"`--dependency-type {flags.dependency_type}` is not known",
                "use one of " + ", ".join(DEPENDENCY_TYPES),
            )
        )
    if flags.command is not None:
        problems += _command_problems(flags.command)
    return problems


def _command_problems(command: str) -> list[Diagnostic]:
    try:
        words = shlex.split(command)
    except ValueError as err:
        return [
            _flag_error(
                "submit.command",
                f"cannot split `--command {command}` into words: {err}",
                'quote it like a shell command line, e.g. --command "python x.py --a 1"',
            )
        ]
    if not words:
        return [
            _flag_error(
                "submit.command",
                "`--command` is empty",
                'give the program each rank runs, e.g. --command "python x.py"',
            )
        ]
    return []


def _flag_error(code: str, message: str, help: str) -> Diagnostic:
    return Diagnostic(code=code, message=message, file="command line", help=help)
