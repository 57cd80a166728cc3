"""Injected faults, so tests can prove the failure paths: one failing rank ends the whole job
promptly, and a time-limit signal saves and stops at the next step boundary."""

from __future__ import annotations

import os
import signal


def inject_failure(rank: int, phase: str) -> None:
    """RLFLOW_TEST_FAIL="RANK:PHASE" (e.g. "1:setup", "1:step2") makes that rank raise there;
    RLFLOW_TEST_SIGNAL="RANK:PHASE" sends that rank SIGUSR1 (Slurm's time-limit warning)."""
    if os.environ.get("RLFLOW_TEST_FAIL") == f"{rank}:{phase}":
        raise RuntimeError(f"injected failure on rank {rank} during {phase}")
    if os.environ.get("RLFLOW_TEST_SIGNAL") == f"{rank}:{phase}":
        os.kill(os.getpid(), signal.SIGUSR1)
