"""What a node launcher records in its attempt's status directory (rlflow/job/files.py names
the files), and the root-cause rule that decides which failure is recorded.

The batch script's retry decision (rlflow/job/attempts.py) and `rlflow status` read these:
node-K.started / node-K.ended (a node that started and never ended was lost), node-K.alive (a
counter bumped while the launcher lives: the batch script's lost-node watch), the job's first
failure (first writer wins), each node's own failure, and stopped-node-K (saved and stopped).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from rlflow.errors import EX_PEER_FAILED, EX_TEMPFAIL
from rlflow.job import files
from rlflow.job.ranks import NodeInfo, Rank, describe_exit, names

# How often a live launcher bumps node-K.alive. The batch script takes a launcher whose counter
# has not changed for 15 s, once another node ended or a failure is recorded, for a lost node.
ALIVE_SECONDS = 2.0


def root_cause(ranks: list[Rank]) -> Rank | None:
    """The rank whose exit is the node's failure: non-zero, not 75 (saved and stopped for a
    requeue), root cause first (a rank that only saw a peer die, exit 76, comes last)."""
    failed = [r for r in ranks if r.exit_code not in (None, 0, EX_TEMPFAIL)]
    failed.sort(key=lambda r: r.exit_code == EX_PEER_FAILED)
    return failed[0] if failed else None


class Books:
    def __init__(self, info: NodeInfo, status_dir: Path):
        self.info, self.status_dir = info, status_dir

    def open(self) -> None:
        (self.status_dir / files.HEARTBEAT).mkdir(parents=True, exist_ok=True)

    def node(self, event: str, text: str) -> None:
        """node-K.started or node-K.ended (`event`: files.STARTED or files.ENDED)."""
        try:
            files.node_record(self.status_dir, self.info.node_rank, event).write_text(text + "\n")
        except OSError:
            pass

    def keep_alive(self) -> None:
        """Bump node-K.alive every ALIVE_SECONDS for as long as this process lives, whatever its
        main thread is doing (saving ranks may take minutes to stop). A daemon thread: start it
        after the ranks are spawned, as a fork (preexec_fn) beside a thread can deadlock."""
        path = files.node_record(self.status_dir, self.info.node_rank, files.ALIVE)

        def write(count: int) -> None:
            try:
                path.write_text(f"{count}\n")
            except OSError:
                pass  # a full or stalled disk: the batch script may judge the node lost

        def bump() -> None:
            count = 1
            while True:
                time.sleep(ALIVE_SECONDS)
                count += 1
                write(count)

        write(1)
        threading.Thread(target=bump, name="rlflow-alive", daemon=True).start()

    def root_failure_recorded(self) -> bool:
        return (self.status_dir / files.FIRST_FAILURE).exists()

    def stopped(self, ranks: list[Rank]) -> None:
        """stopped-node-K: these ranks saved and stopped for a requeue (exit 75)."""
        files.stopped_node(self.status_dir, self.info.node_rank).write_text(
            f"ranks {names(ranks)} on {self.info.hostname} exited 75\n"
        )

    def failure(self, rank: Rank, code: int | None = None, message: str = "") -> None:
        """The first failure of the job (first writer wins): the batch script's exit code.

        Line 1: the exit code; line 2: what happened; line 3: the node's name (the retry
        decision excludes it for a hang or a failed preflight). A rank that only saw a peer
        die (exit 76) is recorded apart, in peer-failure, so a node that noticed the death
        first never hides the node where the error happened."""
        code = rank.exit_code if code is None else code
        if not message:
            note = (rank.heartbeat() or {}).get("note")
            message = (
                f"rank {rank.rank} on {self.info.hostname} (node {self.info.node_rank}) "
                + (f"{note}" if note else describe_exit(code))
                + f"; log: {rank.log_path}"
            )
        text = files.Failure(str(code), message, self.info.hostname).text()
        try:  # every node's own failure too: a preflight may fail on several nodes at once
            files.failure_of_node(self.status_dir, self.info.node_rank).write_text(text)
        except OSError:
            pass
        name = files.PEER_FAILURE if rank.exit_code == EX_PEER_FAILED else files.FIRST_FAILURE
        try:
            fd = os.open(self.status_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as out:
            out.write(text)
