"""The `rlflow` command: a Click group whose subcommands load lazily.

Login nodes are slow and have no GPU, so `rlflow --help`, `rlflow check-pins` and
`rlflow submit --dry-run` must never import torch, megatron or transformers. Each subcommand
lives in its own module and is imported only when it runs; its one-line help is kept here so
that listing the commands imports nothing.
"""

from __future__ import annotations

import importlib
import sys

import click

from rlflow import __version__
from rlflow.errors import RlflowError, print_diagnostics

# name -> (module:attribute, short help). Heavy imports live inside the callbacks.
COMMANDS: dict[str, tuple[str, str]] = {
    "check-pins": (
        "rlflow.pins.command:check_pins",
        "Check that submodule pyproject pins agree with the root pyproject.",
    ),
    "bump": (
        "rlflow.pins.bump:bump",
        "Move a submodule to a ref, and the root pins that follow it, in one commit.",
    ),
    "check-tests": (
        "rlflow.cicheck.command:check_tests",
        "List tests that no CI shard collects.",
    ),
    "submit": (
        "rlflow.launch.command:submit",
        "Render a recipe to an sbatch script and submit it.",
    ),
    "status": ("rlflow.launch.command:status", "Show the state of a submitted job."),
    "logs": ("rlflow.launch.command:logs", "Print (or follow) a job's training log."),
    "cancel": ("rlflow.launch.command:cancel", "Cancel a submitted job."),
    "train": ("rlflow.train.command:train", "Run GRPO training (the per-node entry point)."),
    "init-tiny-model": (
        "rlflow.model.command:init_tiny_model",
        "Write a random Qwen2.5-VL checkpoint (tiny, or 3B-shaped).",
    ),
    "report": ("rlflow.train.command:report", "Plot a run's metrics to PNG files."),
    "setup-env": ("rlflow.envs.command:setup_env", "Build a per-node runtime environment (vLLM)."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        target, _ = COMMANDS[name]
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rlflow")
def cli() -> None:
    """Slurm-native GRPO post-training of vision-language models on megatron-core.

    \b
    Three jobs:
      check-pins   prove submodule pins agree with the root pyproject (pre-commit, pre-launch)
      submit       recipe -> sbatch script -> Slurm (--dry-run checks everything, submits nothing)
      train        the GRPO trainer that runs on the allocation
    """


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become diagnostics and an exit code, not tracebacks."""
    try:
        # With standalone_mode=False, `ctx.exit(code)` inside a command comes back as the return value.
        code = cli.main(args=argv, prog_name="rlflow", standalone_mode=False)
    except RlflowError as err:
        print_diagnostics(err.diagnostics)
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
