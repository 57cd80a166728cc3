"""Weights & Biases beside TensorBoard (`logging.wandb` in the recipe; `pip install rlflow[wandb]`).

The run's W&B id is kept in RUN_DIR/wandb_run_id, written before the first `wandb.init`: a
requeued or resumed attempt reads it back and continues the same W&B run (`resume="allow"`).
The config is the resolved recipe; each step's metrics are the ones metrics.jsonl gets.

W&B ignores a step below the last one a run logged, so an attempt that runs steps again (a
crash after the last checkpoint) cannot continue that run: it gets a new id and a new W&B run,
which first gets metrics.jsonl's kept records (rlflow/train/metrics.py).

Whether wandb is installed is asked without importing it, by the recipe rules
(rlflow/optional.py), which the dry run and `rlflow train` share.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

RUN_ID_FILE = "wandb_run_id"


def run_id(run_dir: Path) -> str:
    """The run's W&B id: read from RUN_DIR/wandb_run_id, or made and written there (atomically)."""
    path = run_dir / RUN_ID_FILE
    if path.is_file():
        text = path.read_text().strip()
        if text:
            return text
    return new_run_id(run_dir)


def new_run_id(run_dir: Path) -> str:
    """A new W&B id for the run directory, replacing its old one (atomically): the run starts
    over, or resumes from a checkpoint older than steps the old W&B run already holds."""
    path = run_dir / RUN_ID_FILE
    new = secrets.token_hex(4)  # W&B ids: letters and digits, unique within the project
    tmp = path.with_name(f".{RUN_ID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(new + "\n")
    os.replace(tmp, path)
    return new


class WandbLogger:
    """One W&B run per run directory, on the main rank only."""

    def __init__(self, cfg, run_dir: Path, config: dict):
        import wandb  # only when enabled: seconds of imports

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
        self._run.log(numbers, step=step)

    def close(self) -> None:
        self._run.finish()
