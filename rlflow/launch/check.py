"""The checks `rlflow submit` runs before anything reaches Slurm; `--dry-run` runs all of them.

Each returns diagnostics (errors block the submission, warnings are shown). Only
`check_cluster` asks Slurm anything (`sinfo`), and only when a Slurm config is there: a login
node with a stale or missing config can still check everything else.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import rlflow.launch.plan as planning
from rlflow import slurm
from rlflow.errors import Diagnostic
from rlflow.launch.plan import JobPlan
from rlflow.recipe.load import LoadedRecipe
from rlflow.rules.allocation import allocation_diagnostics

# Values that land in `#SBATCH` lines: sbatch ends a line at a newline and drops backslashes.
_SBATCH_UNSAFE = re.compile(r"[\x00-\x1f\x7f\\]")


def check_all(
    loaded: LoadedRecipe,
    plan: JobPlan,
    script: str,
    *,
    skip_pins: bool,
    repo_root: Path,
    trains: bool = True,
) -> list[Diagnostic]:
    """Every check, in the order a user would fix things. The allocation rules are the ones
    `rlflow train` runs at setup (rlflow.rules.allocation), with the flags' nodes x GPUs;
    `trains=False` for a `--command` job, whose ranks run no trainer."""
    problems = allocation_diagnostics(loaded, plan.num_nodes, plan.gpus_per_node, trains=trains)
    problems += check_sbatch_values(loaded, plan)
    problems += check_paths(loaded, plan)
    if not skip_pins:
        problems += pin_diagnostics(repo_root)
    problems += check_script_syntax(script)
    return problems


def check_sbatch_values(loaded: LoadedRecipe, plan: JobPlan) -> list[Diagnostic]:
    values: list[tuple[tuple[str, ...], str, str]] = [
        (("run", "name"), "run.name", plan.job_name),
        (("run", "output_dir"), "run.output_dir", plan.run_dir),
        (("slurm", "time_limit"), "slurm.time_limit", plan.time_limit),
    ]
    for key, value in planning.recipe_sbatch_values(loaded.recipe.slurm):
        values.append((tuple(key.split(".")), key, value))
    for i, arg in enumerate(plan.extra_sbatch_args):
        values.append((("slurm", "extra_sbatch_args"), f"slurm.extra_sbatch_args[{i}]", arg))
    problems = [
        _unsafe_value(loaded, path, name, value)
        for path, name, value in values
        if _SBATCH_UNSAFE.search(value)
    ]
    if _SBATCH_UNSAFE.search(plan.workdir):
        problems.append(
            Diagnostic(
                "submit.sbatch-value",
                f"the working directory {plan.workdir!r} contains a newline, "
                "control character or backslash, which an #SBATCH line cannot hold",
                help="submit from a directory with a plainer name",
            )
        )
    if not plan.job_name.strip():
        problems.append(
            loaded.diagnostic(
                ("run", "name"),
                "submit.job-name",
                "`run.name` is empty",
                help="name the run, e.g. clevr-3b",
            )
        )
    return problems + _extra_arg_problems(loaded, plan.extra_sbatch_args)


def _unsafe_value(loaded: LoadedRecipe, path: tuple[str, ...], name: str, value: str) -> Diagnostic:
    return loaded.diagnostic(
        path,
        "submit.sbatch-value",
        f"`{name}` is {value!r}: a newline, control character or backslash cannot go into an "
        f"#SBATCH line (sbatch would end the line there, or drop the backslash)",
        help="use a value without them",
    )


def owned_sbatch_options() -> dict[str, str]:
    """Each spelling of an sbatch option rlflow sets (plan.SBATCH_OPTIONS) -> what sets it: a
    second copy in slurm.extra_sbatch_args would silently win or clash, so it is refused."""
    return {
        spelling: row.source
        for row in planning.SBATCH_OPTIONS
        for spelling in (row.option, *row.spellings)
    }


def _extra_arg_problems(loaded: LoadedRecipe, args: tuple[str, ...]) -> list[Diagnostic]:
    owned = owned_sbatch_options()
    problems = []
    for i, arg in enumerate(args):
        # --long[=value], or -x[value]: the option's own name
        option = arg.split("=", 1)[0] if arg.startswith("--") else arg[:2]
        if not arg.startswith("-"):
            problems.append(
                loaded.diagnostic(
                    ("slurm", "extra_sbatch_args"),
                    "submit.extra-sbatch-arg",
                    f"`slurm.extra_sbatch_args[{i}]` is {arg!r}, which is not an sbatch option",
                    help="write each option as one item, with its value after `=`, "
                    'e.g. "--constraint=h100"',
                )
            )
        elif option in owned:
            problems.append(
                loaded.diagnostic(
                    ("slurm", "extra_sbatch_args"),
                    "submit.extra-sbatch-arg",
                    f"`slurm.extra_sbatch_args[{i}]` sets {option}, which rlflow sets from "
                    f"{owned[option]}",
                    help=f"remove {arg!r} and use {owned[option]} instead",
                )
            )
    return problems


def check_paths(loaded: LoadedRecipe, plan: JobPlan) -> list[Diagnostic]:
    """Run directory: its name fits the file system and it can really be created (errors);
    inputs that are missing here (warnings: some clusters mount data only on compute nodes)."""
    problems = check_run_dir(loaded, plan)
    recipe = loaded.recipe
    inputs = []
    if not recipe.model.checkpoint.startswith("builtin:"):
        inputs.append((("model", "checkpoint"), recipe.model.checkpoint))
    for split in ("train", "validation"):
        dataset = getattr(recipe.data, split)
        if dataset.kind == "jsonl":
            inputs += [
                (("data", split, key), getattr(dataset, key))
                for key in ("path", "image_root")
                if getattr(dataset, key)
            ]
    for path, value in inputs:
        if not Path(plan.workdir, value).exists():
            problems.append(
                loaded.diagnostic(
                    path,
                    "submit.path-missing",
                    f"`{'.'.join(path)}` is {value!r}, which does not exist here",
                    help=_UNREAD_CONFIG if path == ("model", "checkpoint") else _NODES_ONLY,
                    severity="warning",
                )
            )
    return problems


_NODES_ONLY = "fix the path; if it exists only on the compute nodes, this warning is harmless"
_UNREAD_CONFIG = (
    "fix the path; if it exists only on the compute nodes, the rules against its config.json "
    "(heads and experts against the parallel sizes, the context length) run there, at the start "
    "of `rlflow train`"
)


def check_run_dir(loaded: LoadedRecipe, plan: JobPlan) -> list[Diagnostic]:
    """Create the run directory's staging folder (and its missing parents) as `submit` will,
    then remove everything this created: the only sure test of a path is to make it."""
    final = Path(plan.run_dir)
    name_max = _limit(final.parent, "PC_NAME_MAX", 255)
    staging = f".{final.name}.staging"  # the longest name submit creates (rundir.stage)
    if len(staging.encode()) > name_max:
        excess = len(staging.encode()) - name_max
        return [
            loaded.diagnostic(
                ("run", "name"),
                "submit.name-too-long",
                f"`run.name` is {len(loaded.recipe.run.name)} characters: the run directory "
                f"(`{final.name[:24]}...`, staged as .NAME.staging) would need a "
                f"{len(staging.encode())}-byte file name; the file system allows {name_max}",
                help=f"shorten run.name to at most "
                f"{max(len(loaded.recipe.run.name) - excess, 1)} characters",
            )
        ]
    longest = final / "logs" / "slurm-4294967295.out"
    path_max = _limit(final.parent, "PC_PATH_MAX", 4096)
    if len(str(longest).encode()) >= path_max:
        return [
            loaded.diagnostic(
                ("run", "output_dir"),
                "submit.path-too-long",
                f"the run directory's log path would be {len(str(longest).encode())} bytes, "
                f"over the file system's limit of {path_max}",
                help="choose a shorter run.output_dir or run.name",
            )
        ]
    created: list[Path] = []
    folder = final.parent
    try:
        missing = [p for p in (final.parent, *final.parent.parents) if not p.exists()]
        for folder in [*reversed(missing), final.parent / staging]:
            folder.mkdir()
            created.append(folder)
    except OSError as err:
        return [
            loaded.diagnostic(
                ("run", "output_dir"),
                "submit.output-dir",
                f"cannot create the run directory under {final.parent}: "
                f"{err.strerror or err} ({err.filename or folder})",
                help="set run.output_dir to a directory you can write to",
            )
        ]
    finally:
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                pass
    return []


def _limit(directory: Path, name: str, default: int) -> int:
    """A file-system limit (pathconf) at the deepest existing folder of `directory`."""
    existing = next((p for p in (directory, *directory.parents) if p.is_dir()), Path("/"))
    try:
        return os.pathconf(existing, name)
    except (OSError, ValueError):
        return default


def check_cluster(plan: JobPlan) -> tuple[list[Diagnostic], str | None]:
    """The job's shape against the partition's nodes, from `sinfo`: a job asking for more GPUs
    per node (or more nodes) than the partition has is accepted by sbatch and then pends
    forever. Returns the problems and what was checked, or no note when Slurm was not asked
    (no Slurm config on this machine, no sinfo, or no answer)."""
    answer = slurm.partition_gpus()
    if answer is None:
        return [], None
    gpus, default = answer
    partition = plan.partition or default
    if partition is None:
        return [], None
    if partition not in gpus:
        return [], None  # sbatch refuses an unknown partition itself, naming it
    nodes = gpus[partition]
    wanted = plan.gpus_per_node if plan.gpu_request is not None else 0
    fitting = [n for n, count in nodes.items() if count >= wanted]
    most = max(nodes.values(), default=0)
    note = f"partition {partition}: {len(nodes)} nodes, up to {most} GPUs each (sinfo)"
    if not fitting:
        return [
            Diagnostic(
                "submit.gpus",
                f"`--gpus {wanted}`: no node in partition `{partition}` has {wanted} GPUs "
                f"(the most is {most}); Slurm would accept the job and never start it",
                file="command line",
                help=f"use --gpus {most} or fewer (and more --nodes), or a partition with "
                f"larger nodes",
            )
        ], note
    if len(fitting) < plan.num_nodes:
        return [
            Diagnostic(
                "submit.nodes",
                f"`--nodes {plan.num_nodes}`: partition `{partition}` has only {len(fitting)} "
                f"node{'s' * (len(fitting) != 1)} with {wanted} or more GPUs; Slurm would "
                f"accept the job and never start it",
                file="command line",
                help=f"use --nodes {len(fitting)} or fewer, or another partition",
            )
        ], note
    return [], note


def pin_diagnostics(start: Path) -> list[Diagnostic]:
    """`rlflow check-pins` on the repository the job runs from: its findings as diagnostics.

    Outside a git repository, or in one without a root pyproject.toml, there is nothing to
    compare: a warning says so. Findings that are errors refuse the submission.
    """
    from rlflow.errors import RlflowError
    from rlflow.pins.walk import walk

    try:
        checkout = walk(start)
        from rlflow.pins.check import analyse

        analysis = analyse(
            checkout, (checkout.root / "pyproject.toml").read_text(encoding="utf-8"), strict=False
        )
    except RlflowError as err:
        if all(d.category == "pins-unchecked" for d in err.diagnostics):
            return [
                d.replace(severity="warning", message=f"pin check not run: {d.message}")
                for d in err.diagnostics
            ]
        return err.diagnostics
    if not analysis.findings:
        return []
    from rlflow.pins.report import to_diagnostic  # ~50 ms of imports, only for findings

    found = [_rooted(to_diagnostic(f, analysis.findings), checkout.root) for f in analysis.findings]
    errors = sum(d.severity == "error" for d in found)
    if errors:
        found.append(
            Diagnostic(
                "submit.pins",
                f"check-pins found {errors} pin problem{'s' * (errors != 1)} in "
                f"{checkout.root}: not submitting",
                help="fix them (`rlflow check-pins --fix` moves the root pins), or pass "
                "--skip-pin-check to submit anyway",
                category="pins",
            )
        )
    return found


def _rooted(diagnostic: Diagnostic, root: Path) -> Diagnostic:
    """Pin findings name files relative to the repository; submit may run elsewhere."""
    if diagnostic.file is None or Path(diagnostic.file).is_absolute():
        return diagnostic
    return diagnostic.replace(file=str(root / diagnostic.file))


def check_script_syntax(script: str) -> list[Diagnostic]:
    """`bash -n` on the rendered script: a template bug must never reach the queue."""
    try:
        result = subprocess.run(
            ["bash", "-n"], input=script, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return [Diagnostic("submit.bash", f"could not run `bash -n` on the script: {err}")]
    if result.returncode == 0:
        return []
    return [
        Diagnostic(
            "submit.bash",
            "the rendered script does not parse (`bash -n`): " + result.stderr.strip(),
            help="this is a bug in templates/sbatch.sh.j2 or rlflow: please report it "
            "with the output of --dry-run",
        )
    ]
