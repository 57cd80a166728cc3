"""What an attempt of a job ended with, and what the batch script does next.

The batch script runs this after the training step (`python -m rlflow.job.attempts ...`). It
reads what the node launchers left in RUN_DIR/status/attempt-N/ (first-failure, peer-failure,
stopped-node-K, node-K.started/.ended, heartbeat/rank-R.json: rlflow/job/files.py), classifies
the attempt, appends one record to RUN_DIR/attempts.jsonl and prints the decision as one line
on stdout:

    done                  the run finished
    time-limit N          the ranks saved and stopped for the time limit; N such requeues so far
    retry NODES           a node failure: requeue with NODES (comma-separated; - for none) excluded
    fail CODE             stop with CODE: not retryable, or no retries left

Node failures are retried: a hang (exit 77, the watchdog named the node), a failed preflight
(exit 78) and a lost node (a launcher that started and never ended: the node died, or Slurm
lost it). Everything else is the run's own error (a recipe error, an exception on a rank, an
out-of-memory kill) and is not retried: a retry would end the same way.

Standard library only (and rlflow/slurm.py): it runs on the batch host between steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlflow import bounded, slurm
from rlflow.errors import EX_HANG, EX_PREFLIGHT, EX_TEMPFAIL
from rlflow.job import files


@dataclass
class Attempt:
    attempt: int
    job_id: str
    outcome: str  # completed | time-limit | node-failure | failed; a local run's: stopped
    reason: str
    nodes: str  # Slurm's node list of the attempt
    excluded: list[str]  # nodes excluded from the next attempt (cumulative)
    step: int | None  # the furthest step any rank reported
    checkpoint_step: int | None  # the newest complete checkpoint after this attempt
    exit_code: int
    action: str
    bad_nodes: list[str] = field(default_factory=list)
    ended: str = ""


def lost_nodes(status: Path) -> list[str]:
    """Nodes whose launcher started and never recorded its end, or that the batch script found
    lost (node-K.lost: no sign of life for 15 s, even after a "stopping on SIGTERM" record)."""
    lost = []
    for started in sorted(status.glob(f"{files.NODE_PREFIX}*{files.STARTED}")):
        if (
            not started.with_suffix(files.ENDED).exists()
            or started.with_suffix(files.LOST).exists()
        ):
            try:  # the node's host name; bounded: a FIFO or a device there is never waited on
                text = bounded.read_text(started, files.RECORD_MAX_BYTES, errors="replace")
            except OSError:
                text = ""
            lost.append((text.split() or [started.name.removesuffix(files.STARTED)])[0])
    return lost


def furthest_step(status: Path) -> int | None:
    steps = []
    for beat in status.glob(f"{files.HEARTBEAT}/rank-*.json"):
        try:
            steps.append(int(json.loads(bounded.read_bytes(beat, files.RECORD_MAX_BYTES))["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(steps) if steps else None


def classify(status: Path, rc: int) -> tuple[str, str, list[str], int]:
    """(outcome, reason, offending nodes, exit code) of one attempt."""
    failure = files.first_failure(status)
    lost = lost_nodes(status)
    if lost:
        states = {node: slurm.node_state(node) for node in lost}
        reason = "; ".join(
            f"node {node} lost: its launcher never reported an exit"
            + (f" (Slurm: {states[node]})" if states[node] else "")
            for node in lost
        )
        return "node-failure", reason, lost, rc or 1
    if failure is not None:
        code, message, host = failure[1].exit_code, failure[1].message, failure[1].host
        if code in (EX_HANG, EX_PREFLIGHT) and host:
            bad = {host}
            for other in status.glob(f"{files.FAILURE_NODE_PREFIX}*"):
                node = files.Failure.read(other)
                if node and node.code in (str(EX_HANG), str(EX_PREFLIGHT)) and node.host:
                    bad.add(node.host)
            return "node-failure", message, sorted(bad), code
        return "failed", message, [], code
    if rc != 0 and not any(status.glob(f"{files.NODE_PREFIX}*{files.STARTED}")):
        # srun could not start the step on any node: Slurm's side (e.g. a requeue right after a
        # node loss), not the run's. A fresh allocation is worth a retry; no node is to blame.
        return "node-failure", f"Slurm could not start the step (srun exit {rc})", [], rc
    if rc == 0:
        if any(status.glob(f"{files.STOPPED_NODE_PREFIX}*")):
            return "time-limit", "saved and stopped for the time limit", [], EX_TEMPFAIL
        return "completed", "finished", [], 0
    return "failed", f"the training step ended with exit code {rc}", [], rc


def decide(args: argparse.Namespace) -> tuple[str, Attempt]:
    run_dir, status = Path(args.run_dir), Path(args.status_dir)
    previous = files.read_attempts(run_dir)
    excluded = list(previous[-1]["excluded"]) if previous else []
    outcome, reason, bad, code = classify(status, args.rc)
    retries = sum(1 for r in previous if r["outcome"] == "node-failure")
    timeouts = sum(1 for r in previous if r["outcome"] == "time-limit")
    if outcome == "completed":
        decision, action = "done", "done"
    elif outcome == "time-limit":
        decision = f"time-limit {timeouts}"
        action = (
            "requeue"
            if timeouts < args.max_requeues
            else f"stop: no requeues left (slurm.max_requeues={args.max_requeues})"
        )
    elif outcome == "node-failure" and retries < args.max_failure_retries:
        excluded = sorted(set(excluded) | set(bad))
        decision = f"retry {','.join(excluded) or '-'}"
        action = (
            f"requeue without {', '.join(bad) or 'excluding a node'} (retry {retries + 1} of "
            f"slurm.max_failure_retries={args.max_failure_retries})"
        )
    elif outcome == "node-failure":
        decision = f"fail {code}"
        action = (
            f"stop: node-failure retries exhausted "
            f"(slurm.max_failure_retries={args.max_failure_retries})"
        )
    else:
        decision = f"fail {code}"
        action = "stop: not retried (a retry would fail the same way)"
    record = Attempt(
        attempt=args.attempt,
        job_id=args.job_id,
        outcome=outcome,
        reason=reason,
        nodes=args.nodes,
        excluded=excluded,
        step=furthest_step(status),
        checkpoint_step=files.checkpoint_step(run_dir),
        exit_code=code,
        action=action,
        bad_nodes=bad,
        ended=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    return decision, record


def local_attempt(run_dir: Path, status: Path, *, attempt: int, rc: int, host: str,
                  stopped_by: str | None) -> Attempt:  # fmt: skip
    """The record of a local run's attempt (`rlflow train --nproc`, one command): nothing is
    retried or requeued here; a run that stopped is resumed by running the same command.

    stopped_by: the signal that asked the ranks to stop (SIGHUP, SIGINT, SIGTERM), if any."""
    failure = files.first_failure(status)
    saved = rc == 0 and any(status.glob(f"{files.STOPPED_NODE_PREFIX}*"))
    if failure is not None:
        outcome, reason, code = "failed", failure[1].message, failure[1].exit_code
    elif saved:
        outcome, reason, code = "stopped", f"saved and stopped on {stopped_by}", EX_TEMPFAIL
    elif rc == 0:
        outcome, reason, code = "completed", "finished", 0
    elif stopped_by is not None:
        outcome, reason, code = "stopped", f"stopped on {stopped_by} without saving", rc
    else:
        outcome, reason, code = "failed", f"the launcher ended with exit code {rc}", rc
    action = {
        "completed": "done",
        "stopped": "resume: the same command continues from the newest checkpoint",
        "failed": "stop: not retried (a retry would fail the same way)",
    }[outcome]
    return Attempt(
        attempt=attempt,
        job_id="",
        outcome=outcome,
        reason=reason,
        nodes=host,
        excluded=[],
        step=furthest_step(status),
        checkpoint_step=files.checkpoint_step(run_dir),
        exit_code=code,
        action=action,
        ended=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )


def append(run_dir: Path, record: Attempt) -> None:
    files.append_attempt(run_dir, asdict(record))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlflow.job.attempts")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--status-dir", required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--job-id", default="")
    parser.add_argument("--nodes", default="")
    parser.add_argument("--rc", type=int, required=True)
    parser.add_argument("--max-requeues", type=int, required=True)
    parser.add_argument("--max-failure-retries", type=int, required=True)
    args = parser.parse_args(argv)
    decision, record = decide(args)
    try:
        append(Path(args.run_dir), record)
    except OSError as err:
        print(f"rlflow: cannot record the attempt: {err}", file=sys.stderr)
    if record.outcome not in ("completed", "time-limit"):
        print(f"rlflow: failed: {record.reason}", file=sys.stderr)
        print(f"rlflow: attempt {record.attempt}: {record.action}", file=sys.stderr)
    print(decision, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
