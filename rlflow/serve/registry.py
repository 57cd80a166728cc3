"""The job's servers in the run directory: `RUN_DIR/servers/rank-R.json`, one file per generation
rank, written by the rank (rlflow/serve/job.py) and read by clients, `wait_ready` and
`rlflow status`. Standard library only: login nodes read it (no torch).

A record: {"rank", "url", "weight_version", "state", "error", "node", "pid", "time"}. States:

    waiting_for_weights   the rank is up; its server starts after the first weight load or sync
    ready                 `url` answers with the weights of `weight_version`
    failed                the first weight load or sync failed (`error` says why): no server
    stopped               the run ended; the server is gone

Every write replaces the file whole (a temporary file in the same folder, then a rename), so a
reader sees the old record or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError
from rlflow.job import files

SERVERS = "servers"
STATES = ("waiting_for_weights", "ready", "failed", "stopped")
_RECORD_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerRecord:
    rank: int
    url: str | None
    weight_version: int | None
    state: str
    error: str | None = None
    node: str | None = None  # the machine it runs on
    time: float = 0.0  # wall clock of the write


def record_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / SERVERS / f"rank-{rank}.json"


def publish(
    run_dir: Path, rank: int, url: str | None, weight_version: int | None, state: str,
    error: str | None = None,
) -> Path:  # fmt: skip
    """Write rank `rank`'s record atomically; returns its path."""
    if state not in STATES:
        raise ValueError(f"server state {state!r} is not one of {STATES}")
    path = record_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank, "url": url, "weight_version": weight_version, "state": state,
        "error": error, "node": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
    }  # fmt: skip
    fd, temporary = tempfile.mkstemp(prefix=f".rank-{rank}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(record, out)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def read(run_dir: Path, rank: int) -> ServerRecord | None:
    """Rank `rank`'s record; None when it has not published one. A damaged file is an error
    naming it."""
    path = record_path(run_dir, rank)
    try:
        with path.open("rb") as handle:
            raw = handle.read(_RECORD_MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    try:
        if len(raw) > _RECORD_MAX_BYTES:
            raise ValueError(f"more than {_RECORD_MAX_BYTES} bytes")
        data = json.loads(raw)
        return ServerRecord(
            rank=int(data["rank"]), url=data["url"], weight_version=data["weight_version"],
            state=str(data["state"]), error=data.get("error"), node=data.get("node"),
            time=float(data.get("time", 0.0)),
        )  # fmt: skip
    except (ValueError, KeyError, TypeError) as exc:
        raise RlflowError(
            Diagnostic(
                "serve.registry-damaged",
                f"{path} is not a server record: {exc}",
                help="the generation rank rewrites it at its next weight update; remove it if "
                "the run is over",
            )
        ) from None


def read_all(run_dir: Path) -> list[ServerRecord]:
    """Every published record, by rank."""
    folder = Path(run_dir) / SERVERS
    if not folder.is_dir():
        return []
    ranks = sorted(
        int(p.stem.removeprefix("rank-"))
        for p in folder.glob("rank-*.json")
        if p.stem.removeprefix("rank-").isdigit()
    )
    return [r for r in (read(run_dir, rank) for rank in ranks) if r is not None]


def wait_ready(
    run_dir: Path, ranks: list[int], timeout_s: float, *, poll_s: float = 0.1
) -> list[ServerRecord]:
    """The records of `ranks` once every one is `ready`; bounded by `timeout_s`
    (`generation.server.ready_timeout_s`). A rank whose first weight load or sync failed, or
    whose run stopped, ends the wait at once with its error; at the timeout the error names each
    rank still waiting, its URL and its last state."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = {rank: read(run_dir, rank) for rank in ranks}
        for record in records.values():
            if record is not None and record.state in ("failed", "stopped"):
                raise RlflowError(_ended(run_dir, record))
        if all(r is not None and r.state == "ready" for r in records.values()):
            return [records[rank] for rank in ranks]
        failure = _job_failure(Path(run_dir), [r for r in records.values() if r is not None])
        if failure is not None:  # a rank died before it could say so (a peer, a node)
            raise RlflowError(failure)
        if time.monotonic() >= deadline:
            raise RlflowError(_timed_out(run_dir, records, timeout_s))
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))


def _job_failure(run_dir: Path, records: list[ServerRecord]) -> Diagnostic | None:
    """The launcher's failure record of the newest attempt (a job that died before its ranks
    wrote a record, too), unless a record is newer (a later attempt's ranks are up)."""
    attempts = files.attempt_dirs(run_dir)
    found = files.first_failure(attempts[-1]) if attempts else None
    if found is None:
        return None
    path, failure = found
    try:
        if records and path.stat().st_mtime < min(r.time for r in records):
            return None  # an earlier attempt's
    except OSError:
        return None
    return Diagnostic(
        "serve.job-failed",
        f"the job failed before its servers were ready: {failure.message} "
        f"(exit {failure.code}, {failure.host or 'host unknown'}; {path})",
        help=f"the logs are under {run_dir / files.LOGS}",
    )


def _ended(run_dir: Path, record: ServerRecord) -> Diagnostic:
    if record.state == "failed":
        served = "its server stopped" if record.url else "its first weight load/sync failed"
        return Diagnostic(
            "serve.rank-failed",
            f"generation rank {record.rank} will not serve: {served}: {record.error}",
            help=f"the job stops on this error; its logs are under {Path(run_dir) / files.LOGS}",
        )
    return Diagnostic(
        "serve.stopped",
        f"generation rank {record.rank}'s server ({record.url}) has stopped: the run ended",
        help="start the run again (or `rlflow serve` a checkpoint of it)",
    )


def _timed_out(run_dir: Path, records: dict, timeout_s: float) -> Diagnostic:
    waiting = [(rank, r) for rank, r in records.items() if r is None or r.state != "ready"]
    lines = [
        f"rank {rank}: "
        + (
            f"no record in {record_path(run_dir, rank)} (the rank has not started)"
            if r is None
            else f"URL {r.url or 'none yet'}, last state {r.state} (weight version "
            f"{r.weight_version}, on {r.node})"
        )
        for rank, r in waiting
    ]
    return Diagnostic(
        "serve.ready-timeout",
        f"the job's servers were not ready after {timeout_s:g} s "
        f"(generation.server.ready_timeout_s): {lines[0]}",
        notes=tuple(lines[1:]),
        help="`rlflow status RUN_DIR` shows each rank's state; its log says what it is doing",
    )
