"""`rlflow train` (Click). Heavy imports stay inside the callback."""

from __future__ import annotations

import sys

import click


@click.command(
    epilog="""\b
Examples:
  rlflow train recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml
  rlflow train recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml grpo.max_num_steps=5 --run-dir runs/try
  rlflow train recipes/tiny-qwen25vl-clevr-1n1g-cpu.yaml --nproc 2     # two local ranks (data parallel)
"""
)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where checkpoints and metrics go (default: run.output_dir/run.name). "
    "A run directory with checkpoints resumes from the newest.",
)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=None,
    help="Start this many local ranks (one per GPU, or CPU processes) and wait for them.",
)
def train(recipe, overrides, run_dir, nproc):
    """Run GRPO training (the per-node entry point).

    RECIPE is a YAML recipe; OVERRIDES are dotted key=value pairs (grpo.max_num_steps=20).
    Under `rlflow submit`, every rank runs this with RANK/WORLD_SIZE/MASTER_ADDR set by the
    launcher; run directly, it is one rank unless --nproc asks for more.
    """
    from rlflow.train.main import default_run_dir, run

    if nproc and nproc > 1:
        from pathlib import Path

        from rlflow.job.local import run_local
        from rlflow.rules import load_checked
        from rlflow.train.storage import prepare_run_dir

        checked = load_checked(recipe, overrides).recipe
        directory = Path(run_dir) if run_dir else default_run_dir(checked)
        prepare_run_dir(directory)  # the ranks' logs go there: a read-only one is a diagnostic
        argv = [
            sys.executable,
            "-m",
            "rlflow.cli",
            "train",
            recipe,
            *overrides,
            "--run-dir",
            str(directory),
        ]
        watch = checked.watchdog
        sys.exit(
            run_local(
                argv,
                nproc,
                directory,
                startup_timeout=watch.startup_timeout_s if watch.enabled else None,
                stop_signal=checked.slurm.stop_signal,
                resume_command=["rlflow", "train", recipe, *overrides]
                + ["--run-dir", str(directory), "--nproc", str(nproc)],
            )
        )

    sys.exit(run(recipe, list(overrides), run_dir))
