"""Injected faults, so tests can prove the failure paths: one failing rank ends the whole job
promptly, and a time-limit signal saves and stops at the next step boundary."""

from __future__ import annotations

import os
import signal


def inject_failure(rank: int, phase: str) -> None:
    """RLFLOW_TEST_FAIL="RANK:PHASE" (e.g. "1:setup", "1:step2") makes that rank raise there;
    RLFLOW_TEST_SIGNAL="RANK:PHASE[:NAME]" sends that rank SIGNAME (default SIGUSR1, Slurm's
    time-limit warning; "0:step2:HUP" sends SIGHUP)."""
    if os.environ.get("RLFLOW_TEST_FAIL") == f"{rank}:{phase}":
        raise RuntimeError(f"injected failure on rank {rank} during {phase}")
    target, _, name = os.environ.get("RLFLOW_TEST_SIGNAL", "").rpartition(":")
    if f"SIG{name}" not in signal.Signals.__members__:  # "RANK:PHASE": no signal name
        target, name = os.environ.get("RLFLOW_TEST_SIGNAL", ""), "USR1"
    if target == f"{rank}:{phase}":
        os.kill(os.getpid(), signal.Signals[f"SIG{name}"])
