"""Stop requests from Slurm: the time-limit warning (slurm.stop_signal) and SIGTERM (preemption,
scancel).

The handler only sets a flag (and tells the launcher it heard it, so the launcher stops
repeating it); the train loop checks it between steps, where all ranks agree (a max over ranks),
saves a checkpoint, and exits with EX_TEMPFAIL (rlflow.errors). The sbatch script treats that
code as "requeue me": the requeued job resumes from the checkpoint.

The rank listens to slurm.stop_signal (HUP by default: what the launcher passes the warning on
as), SIGUSR1 (Slurm's own name for the warning, for a rank run without the launcher) and
SIGTERM. Libraries can replace these handlers at the C level without Python knowing: Triton's
first kernel compile installs LLVM's handlers, whose SIGUSR1 handler swallows the signal, while
its SIGHUP and SIGTERM handlers pass it on (rlflow/train/sigstate.py). So on every phase change
the rank puts its handlers back where they were replaced, and says so once in its log.

Once the stop is under way (`stopping()`), a repeated warning is ignored outright: Python
restores the default action of handled signals while the interpreter shuts down, and the default
action of SIGUSR1 and SIGHUP is to die, which turned a clean "saved, exit 75" into "killed by
signal 10" whenever a warning arrived during the exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from rlflow import parallel
from rlflow.train import sigstate, watchdog

STOP_SIGNAL_ENV = "RLFLOW_STOP_SIGNAL"  # set by the launcher: the time-limit signal's name


def warning_signal(recipe_signal: str) -> signal.Signals:
    """The time-limit warning: the launcher's RLFLOW_STOP_SIGNAL, else the recipe's
    slurm.stop_signal (the same key: the launcher passes on what the recipe says)."""
    name = os.environ.get(STOP_SIGNAL_ENV) or recipe_signal
    return signal.Signals[f"SIG{name}"]


class StopRequest:
    def __init__(self, enabled: bool, stop_signal: str):
        self.signal_name: str | None = None
        self.enabled = enabled
        self.warning = warning_signal(stop_signal)
        self.signals = sorted({self.warning, signal.SIGUSR1, signal.SIGTERM})
        self._handler: int | None = None  # Python's C-level handler, once installed
        self._noted: set[tuple[int, str | None]] = set()
        if enabled:
            for sig in self.signals:
                signal.signal(sig, self._handle)
            self._handler = sigstate.handler_address(self.warning)
            watchdog.keep(self.keep_handlers)

    def _handle(self, signum, frame) -> None:
        first = self.signal_name is None
        self.signal_name = signal.Signals(signum).name
        if first:
            watchdog.stop_requested()

    def keep_handlers(self) -> None:
        """Put rlflow's handlers back where a library replaced them (called on phase changes)."""
        if self._handler is None or self.signal_name is not None:
            return
        if threading.current_thread() is not threading.main_thread():
            return  # Python installs handlers from the main thread only; it checks again soon
        for sig in self.signals:
            now = sigstate.handler_address(sig)
            if now is None or now == self._handler:
                continue
            who = sigstate.owner(sig)
            signal.signal(sig, self._handle)
            if (sig, who) not in self._noted:
                self._noted.add((sig, who))
                print(
                    f"rlflow: {who} had replaced the {sig.name} handler at the C level "
                    f"(by phase `{watchdog.phase()}`); rlflow's handler is back",
                    file=sys.stderr,
                    flush=True,
                )

    def agreed(self) -> bool:
        """True on every rank if any rank was signalled (a collective: call on all ranks)."""
        self.keep_handlers()
        return parallel.all_reduce_max(1.0 if self.signal_name else 0.0) > 0

    def stopping(self) -> None:
        """From here on the rank only saves and exits: further warnings are ignored (SIG_IGN
        survives interpreter shutdown, a Python handler does not)."""
        if self.enabled:
            for sig in self.signals:
                if sig != signal.SIGTERM:
                    signal.signal(sig, signal.SIG_IGN)
