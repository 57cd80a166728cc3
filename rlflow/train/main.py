"""`rlflow train` on one rank: recipe -> setup -> train -> close, failing fast.

A failure on any rank must end the whole job within seconds, with the root error printed once,
never a collective hang: the rank that fails prints its error and leaves with os._exit (no
atexit or process-group teardown, which could block on dead peers); the launcher
(`rlflow.job.node`) then stops the other ranks. A rank whose error is only the echo of a
peer's death (a broken connection in a collective) prints one line, not a second traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from rlflow.errors import EX_PEER_FAILED, RlflowError, print_diagnostics, summary_line
from rlflow.train.faults import inject_failure

_PEER_FAILURE_HINTS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL",
    "Socket Timeout",
)


def default_run_dir(recipe) -> Path:
    return Path(recipe.run.output_dir) / recipe.run.name


def run(recipe_path: str, overrides: list[str], run_dir: str | None) -> int:
    """Returns the process exit code; never raises."""
    from rlflow.compat import library_logs
    from rlflow.job.preflight import PreflightFailed
    from rlflow.rules import load_checked
    from rlflow.train import watchdog

    watchdog.start()  # stack dumps on request; progress reports when a launcher asks for them
    library_logs.quiet()
    rank = int(os.environ.get("RANK", "0"))
    try:
        loaded = load_checked(recipe_path, overrides)
        watchdog.configure(loaded.recipe.watchdog)
        directory = Path(run_dir) if run_dir else default_run_dir(loaded.recipe)
        from rlflow.train.storage import prepare_run_dir

        prepare_run_dir(directory)  # read-only or uncreatable: a diagnostic, not a traceback
        if rank == 0:
            from rlflow.job.files import RESOLVED_RECIPE
            from rlflow.recipe.load import dump_recipe

            (directory / RESOLVED_RECIPE).write_text(dump_recipe(loaded.data))
        inject_failure(rank, "setup")
        from rlflow.train.setup import role_of

        if role_of(loaded) == "generate":  # generation.placement separate
            from rlflow.train.generation_role.generator import serve, setup_generator

            generator = setup_generator(loaded, directory)
            code = serve(generator)
            generator.close()
        else:
            from rlflow.train.loop import train
            from rlflow.train.setup import setup

            trainer = setup(loaded, directory)
            code = train(trainer)
            trainer.close()
        _shutdown()
        return code
    except PreflightFailed as err:
        _server_failed(str(err))
        if err.note:
            watchdog.note(err.note)  # the launcher's failure record names this node's checks
        print(f"[rank {rank}] {err}", file=sys.stderr, flush=True)
        _hard_exit(err.exit_code)
    except RlflowError as err:
        # Every rank reports, even an error every rank meets: the first rank to fail is the one
        # whose log the launcher shows (rlflow/job/ranks.py finds the "[rank R] error:" line).
        if os.environ.get("RLFLOW_HEARTBEAT_FILE"):  # under the launcher: logs/rank-R.log
            print(f"[rank {rank}] stopping on {summary_line(err.diagnostics)}:", file=sys.stderr)
        first = err.diagnostics[0]
        _server_failed(f"{first.code}: {first.message}")
        print_diagnostics(err.diagnostics)
        _hard_exit(err.exit_code)
    except BaseException as err:  # noqa: BLE001 - the top of a rank: report, then leave at once
        _server_failed(f"{type(err).__name__}: {err}")
        _hard_exit(EX_PEER_FAILED if _report(err, rank) else 1)
    return 1


def _server_failed(error: str) -> None:
    """generation.server.enabled: this rank's record in RUN_DIR/servers says it failed, naming
    the error (nothing waits for a server that will never answer)."""
    from rlflow.serve.job import mark_failed  # (standard library only at import)

    mark_failed(error)


def _report(err: BaseException, rank: int) -> bool:
    """Print the error once; True when it is only the echo of another rank's death."""
    text = "".join(traceback.format_exception(err))
    if any(hint in text for hint in _PEER_FAILURE_HINTS):
        print(
            f"[rank {rank}] stopping: a peer rank failed (its error is reported by the launcher)",
            file=sys.stderr,
            flush=True,
        )
        return True
    print(f"[rank {rank}] error: {type(err).__name__}: {err}\n{text}", file=sys.stderr, flush=True)
    return False


def _hard_exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _shutdown() -> None:
    from rlflow import parallel

    parallel.shutdown()
