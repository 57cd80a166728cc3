"""Stack dumps of a hang: every local rank's Python stacks, collected into one file.

DUMP_SIGNAL (SIGUSR2) makes each rank's faulthandler write every thread's stack into its log
(rlflow/train/watchdog.py), even a rank blocked inside a collective. The launcher copies what
each log gained into logs/hang-attempt<A>-node<K>.txt.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from rlflow import bounded
from rlflow.job import files
from rlflow.job.ranks import DUMP_SIGNAL, NodeInfo, Rank

DUMP_WAIT_SECONDS = 5.0  # for the ranks' stack dumps to reach their logs
DUMP_MAX_BYTES = 16 << 20  # one rank's stacks: thousands of threads' worth, not a runaway log


def dump_stacks(
    info: NodeInfo, ranks: list[Rank], log_dir: Path, headline: str, attempt: int | None
) -> Path:
    """DUMP_SIGNAL to every rank in `ranks`; their dumps are copied to one hang file (returned),
    named after `attempt` (the status directory's; None: Slurm's restart count).
    A stopped rank (SIGSTOP, state T) gets SIGCONT only once the others have dumped, so their
    stacks show where they waited, not where they went next."""
    offsets = {r.rank: _size(r.log_path) for r in ranks}
    pids = {r.rank: r.pid for r in ranks}
    states = {r.rank: _process_state(pids[r.rank]) for r in ranks}
    for rank in ranks:
        _kill(pids[rank.rank], DUMP_SIGNAL)
    stopped = [r for r in ranks if states[r.rank] == "T"]
    wait_for_dumps([r for r in ranks if r not in stopped], offsets)
    for rank in stopped:
        _kill(pids[rank.rank], signal.SIGCONT)
    wait_for_dumps(stopped, offsets)
    number = os.environ.get("SLURM_RESTART_COUNT", "0") if attempt is None else str(attempt)
    path = files.hang_report(log_dir, number, info.node_rank)
    parts = [f"rlflow watchdog: {headline}\n"]
    for rank in ranks:
        state = states[rank.rank]
        parts.append(
            f"\n==== rank {rank.rank} (pid {pids[rank.rank]}, process state {state}), "
            f"from {rank.log_path} ====\n"
        )
        parts.append(_read_from(rank.log_path, offsets[rank.rank]) or "(no dump arrived)\n")
    try:
        path.write_text("".join(parts))
    except OSError as err:
        info.say(f"cannot write {path}: {err}", sys.stderr)
    return path


def wait_for_dumps(ranks: list[Rank], offsets: dict[int, int]) -> None:
    """Until every rank's log has grown and stopped growing (at most DUMP_WAIT_SECONDS)."""
    deadline = time.monotonic() + DUMP_WAIT_SECONDS
    sizes: dict[int, int] = {}
    while ranks and time.monotonic() < deadline:
        time.sleep(0.5)
        now = {r.rank: _size(r.log_path) for r in ranks}
        if all(now[k] > offsets[k] for k in now) and now == sizes:
            return
        sizes = now


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    """What the log gained after `offset`, its first DUMP_MAX_BYTES (bounded.py: a regular
    file only, a named pipe is never waited on; '' when it cannot be read)."""
    try:
        with bounded.open_regular(path) as log:
            log.seek(offset)
            data = log.read(DUMP_MAX_BYTES + 1)
    except bounded.UnreadableFile as err:
        return f"(not read: {err})\n"
    except OSError:
        return ""
    cut = f"\n(cut at {bounded.size_text(DUMP_MAX_BYTES)})\n" if len(data) > DUMP_MAX_BYTES else ""
    return data[:DUMP_MAX_BYTES].decode(errors="replace") + cut


def _process_state(pid: int) -> str:
    """R running, S sleeping, T stopped (SIGSTOP), D uninterruptible I/O, Z exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"
