"""The hang watch: which rank is silent past its phase's timeout, and whose node names it.

Every rank reports (phase, step, time) to a heartbeat file (rlflow/train/watchdog.py); each
report carries its phase's timeout. A rank silent longer than that is hung. Every rank stops
reporting once one is stuck (the others wait in a collective), so each node's launcher sees its
own ranks go silent: the rank silent longest across the job is the root cause, and the launcher
of its node names it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rlflow import bounded
from rlflow.job import files
from rlflow.job.ranks import NodeInfo, Rank

HEARTBEAT_POLL_SECONDS = 1.0
# A rank on another node silent this much longer (wall clock) is the likelier root cause: its
# launcher names it, while this one waits up to DEFER_SECONDS before naming its own rank.
DEFER_MARGIN_SECONDS = 1.0
DEFER_SECONDS = 20.0


class HangWatch:
    def __init__(
        self, info: NodeInfo, status_dir: Path, local: list[Rank], startup_timeout: float | None
    ):
        self.info, self.status_dir = info, status_dir
        self.local_reports = {r.heartbeat_path.name for r in local}
        self.startup_timeout = startup_timeout  # None: a rank need not report progress
        self.next_check = 0.0
        self.deferred_since: float | None = None

    def check(self, running: list[Rank]) -> tuple[Rank, float, dict] | None:
        """Once a HEARTBEAT_POLL_SECONDS: the hung rank this node should name, if any, as
        (rank, seconds silent, its last report)."""
        if time.monotonic() < self.next_check:
            return None
        self.next_check = time.monotonic() + HEARTBEAT_POLL_SECONDS
        hung = self.find_hung(running)
        if hung is not None and not self.defer_to_other_node(hung[2]):
            return hung
        return None

    def find_hung(self, running: list[Rank]) -> tuple[Rank, float, dict] | None:
        """The rank silent longest past its phase's timeout: (rank, seconds silent, report)."""
        now = time.monotonic()
        late = []
        for rank in running:
            beat = rank.heartbeat()
            if beat is None:
                if self.startup_timeout is None:
                    continue  # a command that does not report progress (smoke tests)
                beat = {"phase": "startup", "step": 0, "time": rank.started_at}
                limit = self.startup_timeout
            else:
                limit = beat.get("timeout_s")
            if limit is not None and now - beat["time"] > limit:
                late.append((now - beat["time"], rank, beat))
        if not late:
            return None
        silent, rank, beat = max(late, key=lambda item: item[0])
        return rank, silent, beat

    def defer_to_other_node(self, beat: dict) -> bool:
        """Whether a rank on another node is the likelier root cause: leave the naming to that
        node's launcher (for at most DEFER_SECONDS: that node may be gone)."""
        if (self.status_dir / files.FIRST_FAILURE).exists():
            return True  # another node has named the cause; srun ends this node next
        mine = beat.get("wall")
        if mine is None:
            return False
        now = time.time()
        for path in (self.status_dir / files.HEARTBEAT).glob("rank-*.json"):
            if path.name in self.local_reports:
                continue
            try:
                other = json.loads(bounded.read_bytes(path, files.RECORD_MAX_BYTES))
            except (OSError, ValueError):
                continue
            limit, wall = other.get("timeout_s"), other.get("wall")
            if limit is None or wall is None:
                continue
            if wall < mine - DEFER_MARGIN_SECONDS and now - wall > limit:
                if self.deferred_since is None:
                    self.deferred_since = time.monotonic()
                    self.info.say(f"a rank on another node is silent longer ({path.name}): waiting")
                return time.monotonic() - self.deferred_since < DEFER_SECONDS
        return False
