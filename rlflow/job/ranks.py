"""This node's rank processes: start them, signal them, stop them; and the reaper.

Each rank runs in its own process group (a wrapper such as `uv run` or `bash -c` stops with its
children), with the torch.distributed environment, its output in logs/rank-R.log, and the
time-limit warning and the dump signal ignored until it installs its own handlers. The ranks
never outlive the launcher: each has PR_SET_PDEATHSIG(SIGKILL), and the reaper, a separate
small process, kills their process groups when the launcher dies, even of SIGKILL.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlflow import bounded
from rlflow.job import files

DUMP_SIGNAL = signal.SIGUSR2  # rlflow/train/watchdog.py: faulthandler dumps every stack
KILL_GRACE_SECONDS = 10.0  # SIGTERM -> SIGKILL, like Slurm's KillWait
POLL_SECONDS = 0.1
PR_SET_PDEATHSIG = 1
LOG_TAIL_BYTES = 64 * 1024  # how much of a failed rank's log is read for its error report
REPORT_LINES = 60  # the most lines of that report the launcher prints
# Where a rank's own error report starts (rlflow/train/main.py prints "[rank R] error: ...",
# then the diagnostics or the traceback); failing that, where Python's own traceback starts (an
# error before main.py's handler, an import error); failing both, the log's last lines.
_REPORT_START = re.compile(r"^\[rank \d+\] ")
_TRACEBACK_START = re.compile(r"^Traceback \(most recent call last\):")


@dataclass(frozen=True)
class NodeInfo:
    node_rank: int
    num_nodes: int
    ranks_per_node: int
    hostname: str
    master_addr: str
    master_port: str

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.ranks_per_node + local_rank

    def say(self, message: str, stream=None) -> None:
        """One line of the launcher's own output, naming the node."""
        try:
            print(
                f"rlflow node {self.node_rank} ({self.hostname}): {message}",
                file=stream or sys.stdout,
                flush=True,
            )
        except OSError:  # the terminal is gone (closed, or the ssh session dropped): go on
            detach_output()


def detach_output() -> None:
    """Point stdout and stderr at /dev/null: later lines, and the interpreter's last flush, must
    not fail (nor kill the launcher) once the terminal they went to has gone away."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


@dataclass
class Rank:
    rank: int
    local_rank: int
    log_path: Path
    heartbeat_path: Path
    process: subprocess.Popen | None = None
    exit_code: int | None = None  # None while running
    started_at: float = 0.0  # CLOCK_MONOTONIC
    missed_warning: bool = False  # the last warning found the signal ignored (still starting)

    def heartbeat(self) -> dict | None:
        """The rank's last progress report, or None before its first."""
        try:
            return json.loads(bounded.read_bytes(self.heartbeat_path, files.RECORD_MAX_BYTES))
        except (OSError, ValueError):
            return None

    def error_report(self) -> list[str]:
        """The lines of the log that say why this rank stopped (see _REPORT_START)."""
        return error_report(read_tail(self.log_path, LOG_TAIL_BYTES))

    @property
    def pid(self) -> int:
        """The trainer's own pid (from its report), else the process started (a wrapper)."""
        return (self.heartbeat() or {}).get("pid") or self.process.pid


def read_tail(path: Path, limit: int) -> str:
    """The file's last `limit` bytes (a log may be gigabytes); '' when it cannot be read or is
    not a regular file (a named pipe put there would wait for a writer forever)."""
    try:
        with bounded.open_regular(path) as log:
            size = os.fstat(log.fileno()).st_size
            log.seek(max(0, size - limit))
            data = log.read(limit)
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return text.split("\n", 1)[1] if size > limit and "\n" in text else text  # a cut first line


def error_report(text: str, most: int = REPORT_LINES) -> list[str]:
    """From the last report start in `text` to its end, of this attempt only (after the last
    launcher header: the log is appended to by every attempt); a report longer than `most`
    lines keeps its first lines (what failed) and its last (where)."""
    lines = text.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("==== rlflow: rank ")]
    lines = lines[headers[-1] + 1 :] if headers else lines
    while lines and not lines[-1].strip():
        lines.pop()
    start = None
    for pattern in (_REPORT_START, _TRACEBACK_START):
        starts = [i for i, line in enumerate(lines) if pattern.match(line)]
        if starts:
            start = starts[-1]
            break
    report = lines[start:] if start is not None else lines[-20:]
    if len(report) > most:
        head, tail = most // 4, most - most // 4 - 1
        cut = len(report) - head - tail
        report = [*report[:head], f"... ({cut} lines cut: the whole log has them)", *report[-tail:]]
    return report


def describe_exit(code: int) -> str:
    """ "exited with code 2", or "exited with code 137 (killed by SIGKILL)"."""
    try:
        killed = f" (killed by {signal.Signals(code - 128).name})" if code > 128 else ""
    except ValueError:
        killed = ""
    return f"exited with code {code}{killed}"


def names(ranks: list[Rank]) -> str:
    return ",".join(str(r.rank) for r in ranks)


def exit_code(returncode: int) -> int:
    """Popen's returncode as a shell would report it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def rank_environment(base: dict[str, str], info: NodeInfo, local_rank: int) -> dict[str, str]:
    env = dict(base)
    env.update(
        RANK=str(info.global_rank(local_rank)),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_WORLD_SIZE=str(info.ranks_per_node),
        NODE_RANK=str(info.node_rank),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=info.master_port,
    )
    return env


def set_parent_death_signal(signum: int) -> None:
    """Linux: deliver `signum` to this process when its parent dies (survives exec)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the reaper alone covers it


def _rank_preexec(stop_signal: int):
    def preexec() -> None:
        """In each rank, before exec: the warning's and the dump signal's default action would
        kill it (or a wrapper such as `uv run`); SIG_IGN survives exec until the rank installs
        its own handlers. The rank dies with the launcher."""
        for signum in {signal.SIGUSR1, stop_signal, DUMP_SIGNAL}:
            signal.signal(signum, signal.SIG_IGN)
        set_parent_death_signal(signal.SIGKILL)

    return preexec


# The reaper: a separate process holding a pipe from the launcher. At EOF (the launcher ended,
# however it ended) it kills every process group it was told about, unless told "done".
_REAPER = """
import os, signal, sys
groups, done = [], False
for line in sys.stdin:
    line = line.strip()
    if line == "done":
        done = True
        break
    if line.isdigit():
        groups.append(int(line))
if not done:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, sig)
            except OSError:
                pass
        if sig == signal.SIGTERM:
            import time; time.sleep(2)
"""


class Reaper:
    """Kills the ranks' process groups if the launcher dies before saying it is done."""

    def __init__(self, info: NodeInfo):
        self.info = info
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _REAPER],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                text=True,
            )
        except OSError as err:
            self.info.say(f"no reaper ({err}): ranks rely on PR_SET_PDEATHSIG alone", sys.stderr)

    def tell(self, line: str) -> None:
        if self.process is None:
            return
        try:
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
        except (OSError, ValueError):
            pass

    def stop(self) -> None:
        if self.process is not None:
            self.tell("done")
            try:
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass


class Ranks:
    """The node's ranks: `all` of them, in local-rank order."""

    def __init__(
        self, info: NodeInfo, command: list[str], log_dir: Path, status_dir: Path, stop_signal
    ):
        self.info, self.command, self.stop_signal = info, command, stop_signal
        self.all = [
            Rank(
                info.global_rank(i),
                i,
                files.rank_log(log_dir, info.global_rank(i)),
                files.heartbeat(status_dir, info.global_rank(i)),
            )
            for i in range(info.ranks_per_node)
        ]
        self.reaper = Reaper(info)

    def start(self) -> Rank | None:
        """Start every rank; the rank that could not start, if any (the others are stopped)."""
        for rank in self.all:
            rank.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(rank.log_path, "ab") as log:
                log.write(
                    f"==== rlflow: rank {rank.rank} on {self.info.hostname}, "
                    f"job {os.environ.get('SLURM_JOB_ID', '?')} attempt "
                    f"{os.environ.get('SLURM_RESTART_COUNT', '0')}, "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode()
                )
                log.flush()
                try:
                    self._spawn(rank, log)
                except OSError as err:
                    log.write(f"rlflow: cannot run {self.command[0]!r}: {err}\n".encode())
                    rank.exit_code = 127 if isinstance(err, FileNotFoundError) else 126
                    self.stop([r for r in self.all if r.process is not None])
                    return rank
        return None

    def _spawn(self, rank: Rank, log) -> None:
        env = rank_environment(dict(os.environ), self.info, rank.local_rank)
        env["RLFLOW_HEARTBEAT_FILE"] = str(rank.heartbeat_path)
        env["RLFLOW_STOP_SIGNAL"] = self.stop_signal.name.removeprefix("SIG")
        rank.heartbeat_path.unlink(missing_ok=True)  # a previous attempt's report
        rank.started_at = time.monotonic()
        # Own process group: a wrapper (uv run, bash -c) and its children stop together.
        rank.process = subprocess.Popen(
            self.command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_rank_preexec(self.stop_signal),
        )
        self.reaper.tell(str(rank.process.pid))

    def running(self) -> list[Rank]:
        return [r for r in self.all if r.process is not None and r.exit_code is None]

    def poll(self) -> None:
        """Note the exit codes of ranks that ended since the last look."""
        for rank in self.running():
            code = rank.process.poll()
            if code is not None:
                rank.exit_code = exit_code(code)

    def stop(self, ranks: list[Rank], grace: float = KILL_GRACE_SECONDS) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds, to each rank's process group."""
        signal_all(ranks, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(r.process.poll() is None for r in ranks) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        signal_all([r for r in ranks if r.process.poll() is None], signal.SIGKILL)
        for rank in ranks:
            rank.exit_code = exit_code(rank.process.wait())


def signal_all(ranks: list[Rank], signum: int) -> None:
    for rank in ranks:
        try:
            os.killpg(rank.process.pid, signum)
        except ProcessLookupError:
            pass
