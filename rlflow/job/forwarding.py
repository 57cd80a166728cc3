"""Signals to the launcher, and the time-limit warning passed on to the ranks.

The launcher's handlers only queue a signal (`Inbox`); its loop acts on them between polls.
The warning (SIGUSR1 from the batch script, or slurm.stop_signal) goes to every rank as
slurm.stop_signal, and again every WARNING_REPEAT_SECONDS to those that ignored it: ranks start
with it ignored (so an early warning cannot kill a rank still importing torch) and hear it once
they install a handler. A rank that had a handler, or said it heard the warning, never gets it
twice: a second one during its exit would kill it (rlflow/train/signals.py).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from rlflow.job.ranks import Rank, signal_all

WARNING_REPEAT_SECONDS = 5.0  # a rank that missed the warning (no handler yet) hears it again

# Signals that arrive while the launcher is still starting (before Inbox.open installs its
# handlers): recorded, not fatal, so an early time-limit warning cannot kill the launcher.
_early_signals: list[int] = []


def record_early(signum: int, _frame) -> None:
    _early_signals.append(signum)


class Inbox:
    """The signals received and not yet acted on, oldest first."""

    def __init__(self, signals: set[int]):
        self.signals = signals
        self.pending: list[int] = []

    def open(self) -> None:
        for signum in self.signals:
            signal.signal(signum, lambda s, _frame: self.pending.append(s))
        self.pending += _early_signals


class WarningRelay:
    """The time-limit warning, as `stop_signal`, to the ranks that still need it."""

    def __init__(self, stop_signal: signal.Signals):
        self.signal = stop_signal
        self.sent_at: float | None = None  # when the warning was last passed on

    def send(self, ranks: list[Rank]) -> None:
        """The warning to `ranks`, noting which of them ignore it for now."""
        self.sent_at = time.monotonic()
        for rank in ranks:
            rank.missed_warning = _ignores(rank.pid, self.signal)
        signal_all(ranks, self.signal)

    def repeat(self, running: list[Rank]) -> None:
        """Again, every WARNING_REPEAT_SECONDS, to the ranks that ignored it (no handler yet) and
        have not said they heard it: a rank that is saving and exiting must not get it again."""
        if self.sent_at is None or time.monotonic() - self.sent_at < WARNING_REPEAT_SECONDS:
            return
        unheard = [r for r in running if not (r.heartbeat() or {}).get("stop_requested")]
        self.send([r for r in unheard if r.missed_warning])


def _ignores(pid: int, signum: int) -> bool:
    """Whether `pid` ignores `signum` right now (/proc SigIgn); True where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) >> (int(signum) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True
