"""The `rlflow` command: a Click group whose subcommands load lazily.

Login nodes are slow and have no GPU, so `rlflow --help`, `rlflow check-pins` and
`rlflow submit --dry-run` must never import torch, megatron or transformers. Each subcommand
lives in a light module (heavy imports inside its callback), imported when it runs or when
`rlflow --help` lists its one-line help, which is the first line of its docstring: one source.
The group and its command table (`COMMANDS`, cli_group.py) are imported only when click parses
the line: `check-pins` runs on every commit as a pre-commit hook, and reads its usual command
lines without click (rlflow/pins/check.py), which would be a fifth of its time.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become diagnostics and an exit code, not tracebacks."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["check-pins"] and "_RLFLOW_COMPLETE" not in os.environ:
        code = _check_pins(args[1:])
        if code is not None:
            sys.exit(code)
    if args[:1] == ["submit"]:
        # A submission lasts a fraction of a second and makes little cyclic garbage: no
        # collections while it runs, and at exit the interpreter's last one skips what
        # gc.freeze() set aside. Their passes over every object imported were ~6% of a dry run.
        gc.disable()
        atexit.register(gc.freeze)
    from rlflow.cli_group import main as click_main

    click_main(args)


def _check_pins(argv: list[str]) -> int | None:
    """check-pins without click; None when click must parse `argv`. The cyclic garbage
    collector is paused from the first import on (rlflow/pins/check.py says why)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        from rlflow.pins.check import main

        return main(argv)
    finally:
        if collecting:
            gc.enable()


def __getattr__(name: str):
    """`cli` (the Click group) and `COMMANDS` (its table), from cli_group.py on first use."""
    if name in ("cli", "COMMANDS"):
        from rlflow import cli_group

        return getattr(cli_group, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
