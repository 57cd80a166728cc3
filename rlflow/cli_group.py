"""The Click group behind `rlflow` and its command table (cli.py is the console entry).

Commands are imported when named, or when `rlflow --help` lists their one-line help.
"""

from __future__ import annotations

import importlib
import sys

import click

from rlflow import __version__
from rlflow.errors import RlflowError, print_diagnostics

# name -> module:attribute. Heavy imports live inside the callbacks, so listing the commands
# may import these modules: each command's help (its docstring) is its only source.
COMMANDS: dict[str, str] = {
    "check-pins": "rlflow.pins.command:check_pins",
    "bump": "rlflow.pins.bump:bump",
    "check-tests": "rlflow.cicheck.command:check_tests",
    "submit": "rlflow.launch.command:submit",
    "status": "rlflow.launch.command:status",
    "logs": "rlflow.launch.command:logs",
    "cancel": "rlflow.launch.command:cancel",
    "train": "rlflow.train.command:train",
    "init-tiny-model": "rlflow.model.command:init_tiny_model",
    "report": "rlflow.launch.report:report",
    "setup-env": "rlflow.envs.command:setup_env",
    "serve": "rlflow.serve.command:serve",
}


class LazyGroup(click.Group):
    """Commands are imported when named, or listed for their one-line help."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module_name, attr = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command's whole first docstring line, wrapped (click would cut it at 45)."""
        rows = [
            (name, self.get_command(ctx, name).get_short_help_str(limit=200))
            for name in self.list_commands(ctx)
        ]
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


def main(argv: list[str]) -> None:
    """Parse `argv` with click; user errors become diagnostics and an exit code, not tracebacks."""
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
