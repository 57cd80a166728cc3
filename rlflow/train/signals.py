"""Stop requests from Slurm: the time-limit warning (SIGUSR1, or slurm.stop_signal) and SIGTERM
(preemption, scancel).

The handler only sets a flag (and tells the launcher it heard it, so the launcher stops
repeating it); the train loop checks it between steps, where all ranks agree (a max over ranks),
saves a checkpoint, and exits with EX_TEMPFAIL (rlflow.errors). The sbatch script treats that code as "requeue
me": the requeued job resumes from the checkpoint.

Once the stop is under way (`stopping()`), a repeated warning is ignored outright: Python
restores the default action of handled signals while the interpreter shuts down, and the default
action of SIGUSR1 and SIGHUP is to die, which turned a clean "saved, exit 75" into "killed by
signal 10" whenever a warning arrived during the exit.
"""

from __future__ import annotations

import os
import signal

from rlflow import parallel
from rlflow.train import watchdog

STOP_SIGNAL_ENV = "RLFLOW_STOP_SIGNAL"  # set by the launcher: the time-limit signal's name


def warning_signal() -> signal.Signals:
    """The time-limit warning: slurm.stop_signal, passed on by the launcher (default USR1)."""
    name = os.environ.get(STOP_SIGNAL_ENV, "USR1")
    return signal.Signals[f"SIG{name}"]


class StopRequest:
    def __init__(self, enabled: bool):
        self.signal_name: str | None = None
        self.enabled = enabled
        if enabled:
            for sig in (warning_signal(), signal.SIGTERM):
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        first = self.signal_name is None
        self.signal_name = signal.Signals(signum).name
        if first:
            watchdog.stop_requested()

    def agreed(self) -> bool:
        """True on every rank if any rank was signalled (a collective: call on all ranks)."""
        return parallel.all_reduce_max(1.0 if self.signal_name else 0.0) > 0

    def stopping(self) -> None:
        """From here on the rank only saves and exits: further warnings are ignored (SIG_IGN
        survives interpreter shutdown, a Python handler does not)."""
        if self.enabled:
            signal.signal(warning_signal(), signal.SIG_IGN)
