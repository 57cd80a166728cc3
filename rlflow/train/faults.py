"""Injected faults, so tests can prove the failure paths: one failing rank ends the whole job
promptly, and a time-limit signal saves and stops at the next step boundary.

Each variable is "RANK:PHASE" (RANK is the launcher's rank, PHASE e.g. "setup", "step2",
"sync3": the weight sync of version 3):

    RLFLOW_TEST_FAIL    that rank raises there
    RLFLOW_TEST_KILL    that rank kills itself with SIGKILL there (a crash: no error, no cleanup)
    RLFLOW_TEST_HANG    that rank stops there for good, reporting no more progress (a hang)
    RLFLOW_TEST_SIGNAL  that rank gets SIGUSR1 there (Slurm's time-limit warning)
    RLFLOW_TEST_TEAR    a generation rank tears that weight sync: one element of its last bucket
                        arrives wrong
"""

from __future__ import annotations

import os
import signal
import threading


def inject_failure(rank: int, phase: str) -> None:
    """Act on RLFLOW_TEST_FAIL, _KILL, _HANG and _SIGNAL for this rank and phase."""
    here = f"{rank}:{phase}"
    if os.environ.get("RLFLOW_TEST_FAIL") == here:
        raise RuntimeError(f"injected failure on rank {rank} during {phase}")
    if os.environ.get("RLFLOW_TEST_KILL") == here:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("RLFLOW_TEST_HANG") == here:
        threading.Event().wait()  # blocks for good, like a rank stuck in a kernel or a collective
    if os.environ.get("RLFLOW_TEST_SIGNAL") == here:
        os.kill(os.getpid(), signal.SIGUSR1)


def torn(rank: int, phase: str) -> bool:
    """RLFLOW_TEST_TEAR asks this rank to leave part of this weight sync out."""
    return os.environ.get("RLFLOW_TEST_TEAR") == f"{rank}:{phase}"
