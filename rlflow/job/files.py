"""The run directory's file names and record formats, stated once.

The in-job code writes these files (the node launcher, the attempt decision) and the login-node
commands read them (`rlflow status`, `logs`, `cancel`, the live monitor); the batch script gets
the names it tests from here too (rlflow/launch/render.py passes them to the template).

    RUN_DIR/
        job_id                      the Slurm job id (`rlflow submit`)
        recipe.yaml                 the resolved recipe the ranks train
        attempts.jsonl              one record per finished attempt (rlflow/job/attempts.py)
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

Standard library only: the node launcher and the batch script's helper import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

JOB_ID = "job_id"
RECIPE = "recipe.yaml"
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
NODE_PREFIX = "node-"  # node-<K>.started, node-<K>.ended, node-<K>.alive
STARTED = ".started"
ENDED = ".ended"
ALIVE = ".alive"


def attempt_dirs(run_dir: Path) -> list[Path]:
    """RUN_DIR/status/attempt-<A> folders, oldest first."""
    found = [p for p in (run_dir / STATUS).glob(f"{ATTEMPT_PREFIX}*") if attempt_of(p) is not None]
    return sorted(found, key=attempt_of)


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


def rank_log(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank}.log"


def batch_log(log_dir: Path, job_id: str) -> Path:
    return log_dir / f"slurm-{job_id}.out"


def hang_report(log_dir: Path, attempt: str, node_rank: int) -> Path:
    return log_dir / f"hang-attempt{attempt}-node{node_rank}.txt"


@dataclass(frozen=True)
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
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
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
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def append_attempt(run_dir: Path, record: dict) -> None:
    with open(run_dir / ATTEMPTS, "a") as out:
        out.write(json.dumps(record) + "\n")
