"""Step metrics: one JSON line per step, TensorBoard events, and a progress bar (rank 0 only)."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from rlflow import bounded

METRICS_FILE = "metrics.jsonl"
METRICS_MAX_BYTES = 1 << 30  # ~700,000 steps of ~1.5 kB: more is not a metrics file (bounded.py)


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
        self._tb_dir = run_dir / "tensorboard" if enabled and tensorboard else None
        self._bar = None
        self._wandb = None
        on = enabled and wandb is not None and wandb.enabled and wandb.mode != "disabled"
        self._wandb_args = (wandb, run_dir, config or {}) if on else None  # opened by start()
        if not enabled:
            return
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, desc="grpo", unit="step", file=sys.stderr, dynamic_ncols=True
            )

    def start(self, resumed_step: int | None) -> None:
        """Before this attempt logs anything: forget what it will log again. The records after
        the checkpoint being resumed from (`resumed_step`; None: no checkpoint, the run starts
        over and every record goes) were written by an attempt that died before saving them;
        this one runs those steps again. Kept: one record per step, the last written (older
        rlflow versions could leave two), so every step is there once, with the values of the
        attempts that produced the checkpoint. A torn last line goes too. The file is rewritten
        aside and renamed, so a kill meanwhile leaves the old file whole. TensorBoard gets the
        same cut: its new event file starts with a purge of every later step. W&B cannot take
        a step twice: after a cut it gets a new run, which first gets the records kept."""
        if not self.enabled:
            return
        kept, cut = self._truncate(resumed_step) if self.path.exists() else ([], False)
        if self._wandb_args is not None:
            self._open_wandb(-1 if resumed_step is None else resumed_step, kept, cut)
        if self._tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            purge = 0 if resumed_step is None else resumed_step + 1
            self._tb = SummaryWriter(str(self._tb_dir), purge_step=purge)
        if self._bar is not None:
            self._bar.n = resumed_step or 0
            self._bar.refresh()

    def _open_wandb(self, resumed: int = -1, kept: list[dict] = (), cut: bool = False) -> None:
        """The W&B run, holding the `kept` records (those up to step `resumed`) and no later
        step: the run directory's run if it may hold no later step, topped up with the kept
        records it may lack; else a new run, which first gets them all (W&B ignores a step
        below the last one a run logged, so the old run cannot take those steps again)."""
        from rlflow.train import wandb_log

        cfg, run_dir, config = self._wandb_args
        old, held = wandb_log.state(run_dir)  # held None: an older rlflow's file, unknown
        stale = old is not None and (held > resumed if held is not None else cut)
        if stale:
            wandb_log.new_run_id(run_dir)
        else:
            kept = [r for r in kept if held is not None and r["step"] >= held]  # a twice: ignored
        self._wandb = wandb_log.WandbLogger(cfg, run_dir, config)
        for record in kept:
            self._wandb.log(record["step"], record)
        if stale:
            self.write(
                f"W&B: new run {self._wandb.id} (run {old} holds steps that run again); "
                f"{len(kept)} kept steps copied into it from {self.path.name}"
            )

    def _truncate(self, resumed_step: int | None) -> tuple[list[dict], bool]:
        """The records kept, and whether any were cut (see start)."""
        records, torn = _parse(self.path)
        if torn:
            self.write(
                f"{self.path}: removed a torn last line ({len(torn)} bytes: {torn[:60]!r}), "
                f"left by a run that stopped while writing it"
            )
        last = {record["step"]: line for line, record in records}  # the last line of each step
        kept = {
            s: line for s, line in last.items() if resumed_step is not None and s <= resumed_step
        }
        dropped = sorted(s for s in last if s not in kept)
        if dropped:
            why = (
                f"after the checkpoint of step {resumed_step}"
                if resumed_step is not None
                else "by an attempt that left no checkpoint"
            )
            self.write(f"{self.path}: removed steps {_span(dropped)}, logged {why}: they run again")
        if torn or len(kept) < len(records):
            _replace(self.path, "".join(kept[s] + "\n" for s in sorted(kept)))
        by_step = {record["step"]: record for _, record in records}
        return [by_step[s] for s in sorted(kept)], bool(dropped)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._tb_dir is not None and self._tb is None:  # no start(): nothing to purge
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self._tb_dir))
        if self._wandb_args is not None and self._wandb is None:  # no start(): a new run
            self._open_wandb()
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:
            raise _write_failed(self.path, f"appending step {step}", err) from None
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


def _span(steps: list[int]) -> str:
    """ "3", "3-5", or "1, 4-6" for sorted steps."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _replace(path: Path, text: str) -> None:
    """A resume's rewrite of the metrics, whole or not at all (storage.replace_file); a full
    disk leaves the old file as it was."""
    from rlflow.train.storage import replace_file

    try:
        replace_file(path, text)
    except OSError as err:
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)
        raise _write_failed(path, "cutting it back to the checkpoint", err) from None


def _write_failed(path: Path, doing: str, err: OSError):
    """A full or read-only disk while writing metrics: what to do, not a traceback. What is
    on disk then is what a crash leaves, which the next attempt's cut repairs."""
    from rlflow.errors import Diagnostic, RlflowError

    return RlflowError(
        Diagnostic(
            "metrics.write-failed",
            f"cannot write {path} ({doing}): {err.strerror or err}",
            file=str(path),
            help="free space on that disk (or make it writable), then run the same command "
            "again: it resumes from the last checkpoint and logs the later steps once",
        )
    )


def read_metrics(run_dir: Path) -> list[dict]:
    """Every step's record; a torn last line (a run killed mid-write) is left out."""
    records, _ = _parse(run_dir / METRICS_FILE)
    return [record for _, record in records]


def _parse(path: Path) -> tuple[list[tuple[str, dict]], str | None]:
    """(line, record) pairs, and the torn last line if there is one. A damaged line anywhere
    else is an error naming it: only the last line can be cut short by a crash."""
    from rlflow.errors import Diagnostic, RlflowError

    lines = bounded.read_text(path, METRICS_MAX_BYTES, 60, "replace").splitlines()
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
