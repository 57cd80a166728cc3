"""What `rlflow status`, `logs` and `cancel` do with a job: find it, describe it, follow it.

A job is named by its id or by its run directory (which holds `job_id`). The run directory of
a job id comes from Slurm's record of the job's output file (RUN_DIR/logs/slurm-<id>.out).
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlflow import slurm
from rlflow.errors import EXIT_FINDINGS, Diagnostic, RlflowError
from rlflow.job import files

FOLLOW_READ_SECONDS = 0.5
FOLLOW_STATE_SECONDS = 2.0


@dataclass(frozen=True)
class JobRef:
    job_id: str
    run_dir: Path | None


_JOB_ID = re.compile(r"[0-9]{1,12}(_[0-9]{1,9})?")


def resolve(text: str) -> JobRef:
    """A job id or a run directory -> the job id and, where it can be found, the run directory."""
    if _JOB_ID.fullmatch(text):
        return JobRef(text, _run_dir_of(text))
    path = Path(text)
    id_file = path / files.JOB_ID
    if id_file.is_file():
        return JobRef(_read_job_id(id_file), path.resolve())
    raise RlflowError(
        Diagnostic(
            "jobs.unknown",
            f"`{text}` is neither a job id nor a run directory with a `{files.JOB_ID}` file",
            help="pass the number `rlflow submit` printed, or the run directory it created",
        )
    )


def _read_job_id(id_file: Path) -> str:
    """The run directory's `job_id` file, which must hold one job id and nothing else."""
    try:
        text = id_file.read_bytes()[:200].decode("utf-8", "replace").strip()
    except OSError as err:
        raise RlflowError(
            Diagnostic(
                "jobs.job-id-file",
                f"cannot read {id_file}: {err.strerror or err}",
                file=str(id_file),
                help="check the run directory's permissions",
            )
        ) from None
    if not _JOB_ID.fullmatch(text):
        raise RlflowError(
            Diagnostic(
                "jobs.job-id-file",
                f"{id_file} holds {text[:40]!r}, not a Slurm job id",
                file=str(id_file),
                line=1,
                help="`rlflow submit` writes the job id there; if the file was edited, pass the "
                "job id itself (the number `rlflow submit` printed)",
            )
        )
    return text


def _run_dir_of(job_id: str) -> Path | None:
    fields = slurm.job_fields(job_id)
    stdout = Path(fields.get("StdOut", "")) if fields else None
    if (
        stdout
        and stdout.parent.name == files.LOGS
        and (stdout.parent.parent / files.JOB_ID).is_file()
    ):
        from rlflow.launch.sweep_jobs import element_dir

        # A sweep element's batch log is SWEEP_DIR/logs/...: its run dir is in the manifest.
        return element_dir(job_id, stdout) or stdout.parent.parent
    return None


def describe(ref: JobRef) -> str:
    """A few lines: state, time, nodes, restarts, where the logs are, the first failure."""
    fields = slurm.job_fields(ref.job_id)
    if fields is not None:
        lines = [
            f"job {ref.job_id} ({fields.get('JobName', '?')}): {fields.get('JobState', '?')}"
            f", {fields.get('RunTime', '?')} of {fields.get('TimeLimit', '?')}"
            f", nodes {fields.get('NodeList', '?')}",
            f"  reason: {fields.get('Reason', '?')}   exit code: {fields.get('ExitCode', '?')}"
            f"   restarts: {fields.get('Restarts', '0')}",
        ]
        if fields.get("Dependency", "(null)") != "(null)":
            lines.append(f"  waits for: {fields['Dependency']}")
    else:
        record = slurm.accounting(ref.job_id)
        if record is None:
            raise RlflowError(
                Diagnostic(
                    "jobs.not-found",
                    f"Slurm knows no job {ref.job_id} (neither scontrol nor sacct)",
                    help="check the id; SLURM_CONF picks the cluster",
                ),
                EXIT_FINDINGS,
            )
        lines = [
            f"job {ref.job_id} ({record['JobName']}): {record['State']}, {record['Elapsed']} of "
            f"{record['Timelimit']}, nodes {record['NodeList']}",
            f"  exit code: {record['ExitCode']}   started {record['Start']}, ended {record['End']}",
        ]
    if ref.run_dir is not None:
        lines += [
            f"  run dir: {ref.run_dir}",
            f"  logs:    {files.rank_log(ref.run_dir / files.LOGS, 0)} (rank 0), "
            f"{files.batch_log(ref.run_dir / files.LOGS, ref.job_id)} (batch script)",
        ]
        lines += [f"  failure: {line}" for line in _failures(ref.run_dir)]
        lines += _attempts(ref.run_dir)
    return "\n".join(lines)


def _attempts(run_dir: Path) -> list[str]:
    """One line per finished attempt (RUN_DIR/attempts.jsonl), then the final word."""
    records = files.read_attempts(run_dir)
    if not records:
        return []
    lines = ["  attempts:"]
    for r in records:
        step = "-" if r.get("step") is None else r["step"]
        saved = "-" if r.get("checkpoint_step") is None else r["checkpoint_step"]
        excluded = ",".join(r.get("excluded") or []) if r["outcome"] == "node-failure" else ""
        lines.append(
            f"    {r['attempt']}: {r['outcome']} on {r['nodes']} at step {step} (checkpoint "
            f"{saved}){f', excluding {excluded} next' if excluded else ''} -> {r['action']}"
        )
        if r["outcome"] not in ("completed", "time-limit"):
            lines.append(f"       {r['reason']}")
    last = records[-1]
    if last["action"].startswith("stop"):
        count = len(records)
        lines.append(
            f"  final: stopped after {count} attempt{'s' * (count != 1)} with exit code "
            f"{last['exit_code']}: {last['action'].removeprefix('stop: ')}"
        )
    return lines


def _failures(run_dir: Path) -> list[str]:
    """The first failure of each attempt, as the node launcher recorded it."""
    found = []
    for attempt in files.attempt_dirs(run_dir):
        failure = files.first_failure(attempt)
        if failure is not None and failure[1].message:
            found.append(f"{attempt.name}: {failure[1].message}")
    return found


def log_path(ref: JobRef, rank: int, batch: bool) -> Path:
    if ref.run_dir is None:
        raise RlflowError(
            Diagnostic(
                "jobs.no-run-dir",
                f"cannot find the run directory of job {ref.job_id}",
                help="Slurm no longer shows the job (or it was not submitted by rlflow): "
                "pass the run directory instead of the job id",
            ),
            EXIT_FINDINGS,
        )
    if (ref.run_dir / "sweep.json").is_file():
        raise RlflowError(
            Diagnostic(
                "jobs.sweep-dir",
                f"{ref.run_dir} is a sweep: each element has its own logs",
                help="pass an element's directory (SWEEP_DIR/<element>) or its job id "
                "(ARRAY_INDEX, listed by `rlflow status SWEEP_DIR`)",
            )
        )
    logs = ref.run_dir / files.LOGS
    return files.batch_log(logs, ref.job_id) if batch else files.rank_log(logs, rank)


def print_log(path: Path) -> None:
    if not path.is_file():
        raise RlflowError(
            Diagnostic(
                "jobs.no-log",
                f"{path} does not exist (yet)",
                help="a pending job has no logs; `rlflow status` shows its state, "
                "`rlflow logs JOB --follow` waits for them",
            ),
            EXIT_FINDINGS,
        )
    try:
        with open(path, "rb") as log:
            while chunk := log.read(1 << 20):
                sys.stdout.buffer.write(chunk)
    except OSError as err:
        raise RlflowError(
            Diagnostic("jobs.log-unreadable", f"cannot read {path}: {err.strerror or err}"),
            EXIT_FINDINGS,
        ) from None
    sys.stdout.flush()


def follow(path: Path, job_id: str) -> str:
    """Print `path` as it grows until the job reaches a final state; that state."""
    position = 0
    last_check = 0.0
    while True:
        position = _print_new(path, position)
        if time.monotonic() - last_check >= FOLLOW_STATE_SECONDS:
            last_check = time.monotonic()
            state = slurm.job_state(job_id)
            if state is None or state in slurm.FINAL_STATES:
                time.sleep(FOLLOW_READ_SECONDS)  # the last lines may still be on their way
                _print_new(path, position)
                print(f"rlflow: job {job_id} ended: {state or 'unknown'}", file=sys.stderr)
                return state or "UNKNOWN"
        time.sleep(FOLLOW_READ_SECONDS)


def _print_new(path: Path, position: int) -> int:
    try:
        with open(path, "rb") as log:
            log.seek(position)
            data = log.read()
    except FileNotFoundError:
        return position
    except OSError as err:
        raise RlflowError(
            Diagnostic("jobs.log-unreadable", f"cannot read {path}: {err.strerror or err}"),
            EXIT_FINDINGS,
        ) from None
    if data:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return position + len(data)


def cancel(ref: JobRef) -> str:
    state = slurm.job_state(ref.job_id)
    if state in slurm.FINAL_STATES:
        return f"job {ref.job_id} has already ended ({state}): nothing to cancel"
    result = slurm.cancel(ref.job_id)
    if result.returncode != 0:
        raise slurm.failed(f"scancel could not cancel job {ref.job_id}", result)
    return f"cancelled job {ref.job_id} (was {state or 'unknown'})"
