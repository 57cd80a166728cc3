"""The run directory's file names and record formats, stated once.

The in-job code writes these files (the node launcher, the attempt decision) and the login-node
commands read them (`rlflow status`, `logs`, `cancel`, the live monitor); the batch script gets
the names it tests from here too (rlflow/launch/render.py passes them to the template).

    RUN_DIR/
        job_id                      the Slurm job id (`rlflow submit`)
        launcher.json               a local run's launcher (`rlflow train --nproc`): who, since when
        recipe.yaml                 the resolved recipe the ranks train (`rlflow submit`)
        recipe.resolved.yaml        the recipe as rank 0 resolved it (`rlflow train`)
        metrics.jsonl               one record per step (rlflow/train/metrics.py)
        attempts.jsonl              one record per finished attempt (rlflow/job/attempts.py);
                                    a local run's attempt is one `rlflow train --nproc` command
        checkpoints/step_<N>/       the trainer's checkpoints
        logs/
            slurm-<job id>.out      the batch script's log
            rank-<R>.log            each rank's output (the node launcher)
            hang-attempt<A>-node<K>.txt   every local rank's stacks when node K found a hang
        status/attempt-<A>/         what the node launchers of attempt A recorded:
            node-<K>.started        node K's launcher started ...
            node-<K>.ended          ... and ended: started without ended is a lost node
            node-<K>.alive          a counter node K's launcher bumps every 2 s while it lives
            first-failure           the job's first failure (the first writer wins)
            peer-failure            a failure that only echoes a dead peer (exit 76)
            failure-node-<K>        node K's own failure (several nodes may fail preflight)
            stopped-node-<K>        node K's ranks saved and stopped for a requeue (exit 75)
            heartbeat/rank-<R>.json each rank's last progress report (rlflow/train/watchdog.py)

A failure record is three lines: the exit code, what happened, the host name of the node.
JSON lines files (attempts.jsonl, metrics.jsonl) are appended to: only their last line can be
cut short (a writer killed mid-line), so a reader skips a last line without its newline and
nowhere else (read_jsonl).

Standard library only: the node launcher and the batch script's helper import it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, fields
from pathlib import Path

from rlflow import bounded
from rlflow.frozen import frozen

JOB_ID = "job_id"
LAUNCHER = "launcher.json"
METRICS = "metrics.jsonl"
RECIPE = "recipe.yaml"
RESOLVED_RECIPE = "recipe.resolved.yaml"
ATTEMPTS = "attempts.jsonl"
CHECKPOINTS = "checkpoints"
LOGS = "logs"
STATUS = "status"
ATTEMPT_PREFIX = "attempt-"  # status/attempt-<A>
HEARTBEAT = "heartbeat"
FIRST_FAILURE = "first-failure"
PEER_FAILURE = "peer-failure"
FAILURE_NODE_PREFIX = "failure-node-"
STOPPED_NODE_PREFIX = "stopped-node-"
NODE_PREFIX = "node-"  # node-<K>.started, .ended, .alive; .lost (the batch script's verdict)
STARTED = ".started"
ENDED = ".ended"
ALIVE = ".alive"
LOST = ".lost"
RECORD_MAX_BYTES = 64 * 1024  # the most rlflow reads of a heartbeat, failure record, launcher.json
FILE_MAX_BYTES = 8 * 1024 * 1024  # ... of attempts.jsonl or recipe.yaml


def attempt_dirs(run_dir: Path) -> list[Path]:
    """RUN_DIR/status/attempt-<A> folders, oldest first."""
    found = [
        p
        for p in (run_dir / STATUS).glob(f"{ATTEMPT_PREFIX}*")
        if attempt_of(p) is not None and p.is_dir()
    ]
    return sorted(found, key=attempt_of)


def attempt_status(run_dir: Path, attempt: int) -> Path:
    """RUN_DIR/status/attempt-<A>: what the node launchers of attempt A record."""
    return run_dir / STATUS / f"{ATTEMPT_PREFIX}{attempt}"


def next_attempt(run_dir: Path) -> int:
    """The number of a local run's next attempt: one past the newest status/attempt-<A>."""
    found = attempt_dirs(run_dir)
    return attempt_of(found[-1]) + 1 if found else 0


def attempt_of(status: Path) -> int | None:
    """The attempt number of a status/attempt-<A> folder (None for any other name)."""
    number = status.name.removeprefix(ATTEMPT_PREFIX)
    return int(number) if status.name.startswith(ATTEMPT_PREFIX) and number.isdigit() else None


def node_record(status: Path, node_rank: int, event: str) -> Path:
    """node-<K>.started, node-<K>.ended or node-<K>.alive (`event`: STARTED, ENDED, ALIVE)."""
    return status / f"{NODE_PREFIX}{node_rank}{event}"


def failure_of_node(status: Path, node_rank: int) -> Path:
    return status / f"{FAILURE_NODE_PREFIX}{node_rank}"


def stopped_node(status: Path, node_rank: int) -> Path:
    return status / f"{STOPPED_NODE_PREFIX}{node_rank}"


def heartbeat(status: Path, rank: int) -> Path:
    return status / HEARTBEAT / f"rank-{rank}.json"


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest checkpoint folder, RUN_DIR/checkpoints/step_<N>."""
    steps = [
        int(p.name.split("_")[1])
        for p in (run_dir / CHECKPOINTS).glob("step_*")
        if p.name.split("_")[1].isdigit() and p.is_dir()
    ]
    return max(steps) if steps else None


def rank_log(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank}.log"


def batch_log(log_dir: Path, job_id: str) -> Path:
    return log_dir / f"slurm-{job_id}.out"


def hang_report(log_dir: Path, attempt: str, node_rank: int) -> Path:
    return log_dir / f"hang-attempt{attempt}-node{node_rank}.txt"


@frozen
class Failure:
    """A failure record (first-failure, peer-failure, failure-node-K) as its three lines."""

    code: str  # the exit code as written
    message: str
    host: str

    @property
    def exit_code(self) -> int:
        try:
            return int(self.code)
        except ValueError:
            return 1

    def text(self) -> str:
        return f"{self.code}\n{self.message}\n{self.host}\n"

    @classmethod
    def read(cls, path: Path) -> Failure | None:
        """The record at `path`; None if there is none (or it cannot be read)."""
        try:
            lines = bounded.read_text(path, RECORD_MAX_BYTES, errors="replace").splitlines()
        except OSError:  # none, or not a regular file (a FIFO is never waited on), or too long
            return None
        return cls(*(lines + ["", "", ""])[:3])


def first_failure(status: Path) -> tuple[Path, Failure] | None:
    """An attempt's root failure: first-failure, or peer-failure if that is all there is."""
    for name in (FIRST_FAILURE, PEER_FAILURE):
        failure = Failure.read(status / name)
        if failure is not None:
            return status / name, failure
    return None


def read_attempts(run_dir: Path) -> list[dict]:
    """RUN_DIR/attempts.jsonl; a torn last line (the node died mid-write) is skipped."""
    path = run_dir / ATTEMPTS
    if not path.is_file():
        return []
    records = []
    try:
        text = bounded.read_text(path, FILE_MAX_BYTES, errors="replace")
    except OSError:  # replaced by a FIFO or a device since, or grown past any real run's
        return []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def read_jsonl(data: bytes) -> tuple[list[tuple[int, object]], list[tuple[int, str]]]:
    """A JSON lines file's bytes -> ((line number, value) pairs, (line number, problem) pairs).

    A last line without its newline is a write in progress (or cut short by a crash): skipped,
    not a problem. Every other line must be one JSON value, in UTF-8."""
    lines = data.split(b"\n")
    lines.pop()  # after the last newline: empty, or a line still being written
    values, problems = [], []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            values.append((number, json.loads(raw.decode("utf-8"), parse_constant=_constant)))
        except UnicodeDecodeError:
            problems.append((number, "not UTF-8 text"))
        except (ValueError, RecursionError) as err:
            problems.append((number, f"not JSON ({err})"))
    return values, problems


def _constant(name: str) -> float:
    """NaN and Infinity, which Python's json writes for non-finite floats, are read back."""
    return float(name)


def append_attempt(run_dir: Path, record: dict) -> None:
    with open(run_dir / ATTEMPTS, "a") as out:
        out.write(json.dumps(record) + "\n")


# --- a local run's launcher --------------------------------------------------------------------


@frozen
class LauncherRecord:
    """RUN_DIR/launcher.json: the launcher of a local run (`rlflow train --nproc N`), written
    when it starts. Its end is the attempt's record in attempts.jsonl; a launcher that is gone
    without one was killed. The process is known by its pid *and* its start time (and the boot),
    so a pid the system gave to another process since is never taken for the launcher."""

    pid: int
    start_ticks: int  # /proc/<pid>/stat's starttime: clock ticks after boot
    boot_id: str  # /proc/sys/kernel/random/boot_id ("" where there is none)
    host: str
    attempt: int  # its status/attempt-<A> and its attempts.jsonl record
    nproc: int
    command: list[str]  # the command line that started it: the same one resumes the run
    cwd: str
    started: float  # time.time()

    def text(self) -> str:
        return json.dumps({"format": 1, **asdict(self)}) + "\n"

    @classmethod
    def parse(cls, data: object) -> LauncherRecord:
        """From launcher.json's JSON value; ValueError naming the key that is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"a JSON object was expected, not {type(data).__name__}")
        for f in fields(cls):
            if f.name not in data:
                raise ValueError(f"key `{f.name}` is missing")
            check, expected = _LAUNCHER_KEYS[f.name]
            if not check(data[f.name]):
                raise ValueError(f"key `{f.name}` is {short(data[f.name])}, not {expected}")
        return cls(**{f.name: data[f.name] for f in fields(cls)})


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    """A finite number (a time), not a boolean nor an integer beyond any clock."""
    if isinstance(value, float):
        return math.isfinite(value)
    return _integer(value) and abs(value) < 2**63


def short(value: object, width: int = 60) -> str:
    """A value as a message shows it: its repr, cut to `width` characters."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


_LAUNCHER_KEYS = {
    "pid": (lambda v: _integer(v) and v > 0, "a process id"),
    "start_ticks": (_integer, "an integer"),
    "boot_id": (lambda v: isinstance(v, str), "a string"),
    "host": (lambda v: isinstance(v, str), "a string"),
    "attempt": (lambda v: _integer(v) and v >= 0, "an attempt number"),
    "nproc": (lambda v: _integer(v) and v > 0, "a number of ranks"),
    "command": (
        lambda v: isinstance(v, list) and bool(v) and all(isinstance(w, str) for w in v),
        "a command line (a list of strings)",
    ),
    "cwd": (lambda v: isinstance(v, str), "a string"),
    "started": (_number, "a time"),
}


def read_launcher(run_dir: Path) -> LauncherRecord | None:
    """RUN_DIR/launcher.json; None if there is none or it is damaged (not a regular file, too
    long, not a record): `rlflow status` names the damage (rlflow/launch/runfiles.py)."""
    try:
        data = bounded.read_bytes(run_dir / LAUNCHER, RECORD_MAX_BYTES)
        return LauncherRecord.parse(json.loads(data))
    except (OSError, ValueError, RecursionError):
        return None


def this_launcher(*, attempt: int, nproc: int, command: list[str]) -> LauncherRecord:
    """The record of the calling process, as the launcher of `attempt`."""
    import socket  # here, not at the top: `submit` imports this module for its names only
    import time

    return LauncherRecord(
        pid=os.getpid(),
        start_ticks=process_start(os.getpid()) or 0,
        boot_id=boot_id(),
        host=socket.gethostname(),
        attempt=attempt,
        nproc=nproc,
        command=list(command),
        cwd=os.getcwd(),
        started=time.time(),
    )


def write_launcher(run_dir: Path, record: LauncherRecord) -> None:
    """RUN_DIR/launcher.json, replaced whole (a reader never sees half a record)."""
    temp = run_dir / f".{LAUNCHER}.{os.getpid()}"
    temp.write_text(record.text())
    os.replace(temp, run_dir / LAUNCHER)


def launcher_running(record: LauncherRecord) -> bool | None:
    """Whether the record's launcher still runs; None where this machine cannot tell (the
    launcher ran on another host)."""
    import socket

    if record.host != socket.gethostname():
        return None
    if record.boot_id and boot_id() and record.boot_id != boot_id():
        return False  # the machine rebooted since
    start = process_start(record.pid)
    return start is not None and start == record.start_ticks


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/<pid>/stat's field 22); None
    if there is no such process, or it has exited (a zombie), or there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        after_name = stat.rsplit(")", 1)[1].split()
        return None if after_name[0] in ("Z", "X") else int(after_name[19])
    except (OSError, IndexError, ValueError):
        return None


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
