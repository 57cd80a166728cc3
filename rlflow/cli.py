"""The `rlflow` command: a Click group whose subcommands load lazily.

Login nodes are slow and have no GPU, so `rlflow --help`, `rlflow check-pins` and
`rlflow submit --dry-run` must never import torch, megatron or transformers. Each subcommand
lives in a light module (heavy imports inside its callback), imported when it runs or when
`rlflow --help` lists its one-line help, which is the first line of its docstring: one source.
The group itself (cli_group.py) is imported only when click parses the line: `check-pins` runs
on every commit as a pre-commit hook, and reads its usual command lines without click
(rlflow/pins/check.py), which would be a fifth of its time.
"""

from __future__ import annotations

import os
import sys

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
    "report": "rlflow.train.command:report",
    "setup-env": "rlflow.envs.command:setup_env",
}


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become diagnostics and an exit code, not tracebacks."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["check-pins"] and "_RLFLOW_COMPLETE" not in os.environ:
        code = _check_pins(args[1:])
        if code is not None:
            sys.exit(code)
    from rlflow.cli_group import main as click_main

    click_main(args)


def _check_pins(argv: list[str]) -> int | None:
    """check-pins without click; None when click must parse `argv`. The cyclic garbage
    collector is paused from the first import on (rlflow/pins/check.py says why)."""
    import gc

    collecting = gc.isenabled()
    gc.disable()
    try:
        from rlflow.pins.check import main

        return main(argv)
    finally:
        if collecting:
            gc.enable()


def __getattr__(name: str):
    """`rlflow.cli.cli`: the Click group (cli_group.py), imported on first use."""
    if name == "cli":
        from rlflow.cli_group import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
