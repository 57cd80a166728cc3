"""Injected failures, so tests can prove that one failing rank ends the whole job promptly."""

from __future__ import annotations

import os


def inject_failure(rank: int, phase: str) -> None:
    """RLFLOW_TEST_FAIL="RANK:PHASE" (e.g. "1:setup", "1:step2") makes that rank raise there."""
    if os.environ.get("RLFLOW_TEST_FAIL") == f"{rank}:{phase}":
        raise RuntimeError(f"injected failure on rank {rank} during {phase}")
