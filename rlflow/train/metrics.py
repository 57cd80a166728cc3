"""Step metrics: one JSON line per step, TensorBoard events, and a progress bar (rank 0 only)."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class StepTimer:
    """Wall-clock seconds per named phase of a step (generation, logprobs, training, ...)."""

    def __init__(self, sync=None):
        self.seconds: dict[str, float] = {}
        self._sync = sync or (lambda: None)

    @contextmanager
    def __call__(self, phase: str):
        from rlflow.train import watchdog

        watchdog.beat(phase)  # progress for the node launcher's watchdog
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


class MetricsLog:
    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool,
        progress_bar: bool,
        total_steps: int,
        wandb=None,  # the recipe's logging.wandb section (rlflow/train/wandb_log.py)
        config: dict | None = None,  # the resolved recipe, W&B's run config
    ):
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self._tb = None
        self._bar = None
        self._wandb = None
        if not enabled:
            return
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb is not None and wandb.enabled and wandb.mode != "disabled":
            from rlflow.train.wandb_log import WandbLogger

            self._wandb = WandbLogger(wandb, run_dir, config or {})
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, desc="grpo", unit="step", file=sys.stderr, dynamic_ncols=True
            )

    def truncate_after(self, step: int) -> None:
        """On resume, forget steps logged after the checkpoint (they will be run again), and a
        torn last line (the previous attempt died while writing it)."""
        if not self.enabled or not self.path.exists():
            return
        records, torn = _parse(self.path)
        if torn:
            self.write(
                f"{self.path}: removed a torn last line ({len(torn)} bytes: {torn[:60]!r}), "
                f"left by a run that stopped while writing it"
            )
        kept = [line for line, record in records if record["step"] <= step]
        if torn or len(kept) < len(records):
            _replace(self.path, "".join(line + "\n" for line in kept))
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, record)
        if self._bar is not None and "train/reward" in metrics:
            self._bar.n = step
            self._bar.set_postfix(
                reward=f"{metrics['train/reward']:.3f}",
                acc=f"{metrics.get('train/accuracy', 0):.2f}",
                step_s=f"{metrics.get('time/step', 0):.1f}",
            )
            self._bar.refresh()

    def write(self, text: str) -> None:
        """A line for the log that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()


def _replace(path: Path, text: str) -> None:
    """A resume's rewrite of the metrics, whole or not at all (storage.replace_file)."""
    from rlflow.train.storage import replace_file

    replace_file(path, text)


def read_metrics(run_dir: Path) -> list[dict]:
    """Every step's record; a torn last line (a run killed mid-write) is left out."""
    records, _ = _parse(run_dir / METRICS_FILE)
    return [record for _, record in records]


def _parse(path: Path) -> tuple[list[tuple[str, dict]], str | None]:
    """(line, record) pairs, and the torn last line if there is one. A damaged line anywhere
    else is an error naming it: only the last line can be cut short by a crash."""
    from rlflow.errors import Diagnostic, RlflowError

    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a step record")
        except ValueError as err:
            if number == len(lines):
                return records, line
            raise RlflowError(
                Diagnostic(
                    "metrics.damaged",
                    f"line {number} of {path} is not a metrics record ({err})",
                    file=str(path),
                    line=number,
                    help="delete that line (the steps after it were logged fine), or start a new "
                    "run directory",
                )
            ) from None
        records.append((line, record))
    return records, None


def _plain(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value
