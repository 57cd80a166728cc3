"""Weights & Biases beside TensorBoard (`logging.wandb` in the recipe; `pip install rlflow[wandb]`).

The run's W&B id is kept in RUN_DIR/wandb_run_id, written before the first `wandb.init`, with
the highest step that W&B run may hold: a requeued or resumed attempt reads it back and
continues the same W&B run (`resume="allow"`).
The config is the resolved recipe; each step's metrics are the ones metrics.jsonl gets.

W&B ignores a step below the last one a run logged, so an attempt that runs steps the W&B run
may hold again (a crash after the last checkpoint) cannot continue that run: it gets a new id
and a new W&B run, which first gets metrics.jsonl's kept records (rlflow/train/metrics.py). An
attempt that continues the run first gives it the kept records it may lack.

Whether wandb is installed is asked without importing it, by the recipe rules
(rlflow/optional.py), which the dry run and `rlflow train` share.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from rlflow import bounded
from rlflow.errors import Diagnostic

RUN_ID_FILE = "wandb_run_id"
RUN_ID_MAX_BYTES = 4096  # an id and a step: a few dozen bytes
_UNREADABLE_HELP = (
    "it is not what rlflow writes there: this run gets a new W&B run, and the file is replaced"
)


def state(run_dir: Path) -> tuple[str | None, int | None]:
    """(the W&B id, the highest step that W&B run may hold) from RUN_DIR/wandb_run_id: "ID" on
    its first line, the step on its second (-1: none yet; absent, from older rlflow: unknown)."""
    path = run_dir / RUN_ID_FILE
    try:
        lines = bounded.read_text(path, RUN_ID_MAX_BYTES).split()
    except bounded.UnreadableFile as err:  # a FIFO, a device, a huge file: say so, start anew
        warning = Diagnostic(
            "wandb.run-id", f"{path}: {err}", severity="warning", help=_UNREADABLE_HELP
        )
        print(warning.render() + "\n", file=sys.stderr, flush=True)
        return None, None
    except (OSError, ValueError):
        return None, None
    step = int(lines[1]) if len(lines) > 1 and lines[1].lstrip("-").isdigit() else None
    return (lines[0] if lines else None), step


def run_id(run_dir: Path) -> str:
    """The run's W&B id: read from RUN_DIR/wandb_run_id, or made and written there (atomically)."""
    return state(run_dir)[0] or new_run_id(run_dir)


def new_run_id(run_dir: Path) -> str:
    """A new W&B id for the run directory, replacing its old one: the run starts over, or
    resumes from a checkpoint older than steps the old W&B run may hold."""
    new = secrets.token_hex(4)  # W&B ids: letters and digits, unique within the project
    _write_state(run_dir, new, -1)
    return new


def _write_state(run_dir: Path, run: str, step: int) -> None:
    path = run_dir / RUN_ID_FILE
    tmp = path.with_name(f".{RUN_ID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(f"{run}\n{step}\n")
    os.replace(tmp, path)


class WandbLogger:
    """One W&B run per run directory, on the main rank only."""

    def __init__(self, cfg, run_dir: Path, config: dict):
        import wandb  # only when enabled: seconds of imports

        self._run_dir = run_dir

        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group,
            tags=list(cfg.tags),
            mode=cfg.mode,
            id=run_id(run_dir),
            resume="allow",
            name=run_dir.name,
            config=config,
            # WANDB_DIR, where set, wins; else the files go into the run directory.
            dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
            settings=wandb.Settings(console="off"),  # the rank's log already has the output
        )

    @property
    def id(self) -> str:
        return self._run.id

    def log(self, step: int, record: dict) -> None:
        numbers = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        # Recorded first: "may hold step" is then never an understatement (a kill between the
        # two leaves the step in the file, not in W&B, and the next attempt starts a new run).
        _write_state(self._run_dir, self._run.id, step)
        self._run.log(numbers, step=step)

    def close(self) -> None:
        self._run.finish()
