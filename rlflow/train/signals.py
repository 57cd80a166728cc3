"""Stop requests from Slurm: SIGUSR1 (the time-limit warning) and SIGTERM (preemption, scancel).

The handler only sets a flag; the train loop checks it between steps, where all ranks agree
(a max over ranks), save a checkpoint, and exit with EXIT_REQUEUE. The sbatch script treats that
code as "requeue me": the requeued job resumes from the checkpoint.
"""

from __future__ import annotations

import signal

from rlflow import parallel

EXIT_REQUEUE = 75  # EX_TEMPFAIL: state saved, stopped on request; the job script requeues


class StopRequest:
    def __init__(self, enabled: bool):
        self.signal_name: str | None = None
        if enabled:
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def agreed(self) -> bool:
        """True on every rank if any rank was signalled (a collective: call on all ranks)."""
        return parallel.all_reduce_max(1.0 if self.signal_name else 0.0) > 0
