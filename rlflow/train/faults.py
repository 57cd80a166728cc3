"""Injected faults, so tests can prove the failure paths: one failing rank ends the whole job
promptly, and a time-limit signal saves and stops at the next step boundary.

Each variable is "RANK:PHASE" (RANK is the launcher's rank). The phases, in a step's order:

    setup       after the recipe is loaded, before the rank is built (rlflow/train/main.py)
    stepN       the start of step N (a training rank), or of batch N (a generation rank)
    syncN       the weight sync of version N (rlflow/train/generation_role/weight_sync.py)
    loggedN     step N's metrics are written (metrics.jsonl, TensorBoard, W&B)
    savingN     step N's checkpoint files are written, the checkpoint not yet in place
    savedN      step N's checkpoint is complete

    RLFLOW_TEST_FAIL    that rank raises there
    RLFLOW_TEST_KILL    that rank kills itself with SIGKILL there (a crash: no error, no cleanup)
    RLFLOW_TEST_HANG    that rank stops there for good, reporting no more progress (a hang)
    RLFLOW_TEST_SIGNAL  that rank gets SIGUSR1 there (Slurm's time-limit warning)
    RLFLOW_TEST_TEAR    a generation rank tears that weight sync: one element of its last bucket
                        arrives wrong
    RLFLOW_TEST_SKEW    a generation rank changes its weights after that sync passed its
                        fingerprint check (a resharding bug both sides' fingerprints agree on)
"""

from __future__ import annotations

import os
import signal
import threading


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
    if os.environ.get("RLFLOW_TEST_KILL") == f"{rank}:{phase}":
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("RLFLOW_TEST_HANG") == f"{rank}:{phase}":
        threading.Event().wait()  # blocks for good, like a rank stuck in a kernel or a collective


def torn(rank: int, phase: str) -> bool:
    """RLFLOW_TEST_TEAR asks this rank to leave part of this weight sync out."""
    return os.environ.get("RLFLOW_TEST_TEAR") == f"{rank}:{phase}"


def skewed(rank: int, phase: str) -> bool:
    """RLFLOW_TEST_SKEW asks this rank to change its weights after this sync was verified."""
    return os.environ.get("RLFLOW_TEST_SKEW") == f"{rank}:{phase}"
