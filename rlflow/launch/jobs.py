"""What `rlflow status`, `logs` and `cancel` do with a job: find it, describe it, follow it.

A job is named by its id or by its run directory (which holds `job_id`). The run directory of
a job id comes from Slurm's record of the job's output file (RUN_DIR/logs/slurm-<id>.out). A
run directory without a job (`rlflow train --nproc N` on this machine) is a local run:
rlflow/launch/local.py.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlflow import bounded, slurm
from rlflow.errors import EXIT_FINDINGS, Diagnostic, RlflowError
from rlflow.job import files

FOLLOW_READ_SECONDS = 0.5
FOLLOW_STATE_SECONDS = 2.0
FOLLOW_READ_BYTES = 16 << 20  # at most this much per read: the rest comes in the next


@dataclass(frozen=True)
class JobRef:
    job_id: str | None  # None: a local run (rlflow/launch/local.py)
    run_dir: Path | None

    @property
    def local(self) -> bool:
        return self.job_id is None


_JOB_ID = re.compile(r"[0-9]{1,12}(_[0-9]{1,9})?")
JOB_ID_MAX_BYTES = 64  # "<array>_<index>\n" with room to spare; more is not rlflow's file


def resolve(text: str) -> JobRef:
    """A job id or a run directory -> the job id and, where it can be found, the run directory."""
    from rlflow.launch import local

    if _JOB_ID.fullmatch(text):
        return JobRef(text, _run_dir_of(text))
    path = Path(text)
    if path.is_dir() and local.is_local_run(path):
        return JobRef(None, path.resolve())
    id_file = path / files.JOB_ID
    if os.path.lexists(id_file):
        return JobRef(read_job_id(id_file), path.resolve())
    raise RlflowError(
        Diagnostic(
            "jobs.unknown",
            f"`{text}` is neither a job id nor a run directory (one with a `{files.JOB_ID}` file, "
            f"or a local run's `{files.LAUNCHER}`)",
            help="pass the number `rlflow submit` printed, or the run directory `rlflow submit` "
            "or `rlflow train --run-dir` wrote",
        )
    )


def read_job_id(id_file: Path) -> str:
    """A `job_id` file, which must hold one job id and nothing else (a newline may end it).
    Nothing that holds more is taken for a job id: `cancel` acts on it."""
    problem = _job_id_problem(id_file)
    if isinstance(problem, Diagnostic):
        raise RlflowError(problem)
    return problem


def _job_id_problem(id_file: Path) -> str | Diagnostic:
    """The job id in the file, or the diagnostic saying why there is none."""
    help = (
        "`rlflow submit` writes the job id there; if the file was edited, pass the job id "
        "itself (the number `rlflow submit` printed)"
    )
    try:
        with bounded.open_regular(id_file) as handle:
            data = handle.read(JOB_ID_MAX_BYTES + 1)
    except bounded.UnreadableFile as err:
        return Diagnostic(
            "jobs.job-id-file",
            f"{id_file} is not the job id file: {err}",
            file=str(id_file),
            help=help,
        )
    except OSError as err:
        return Diagnostic(
            "jobs.job-id-file",
            f"cannot read {id_file}: {err.strerror or err}",
            file=str(id_file),
            help="check the run directory's permissions",
        )
    text = data.decode("ascii", "replace")
    body = text.removesuffix("\n").removesuffix("\r")
    if len(data) > JOB_ID_MAX_BYTES or not _JOB_ID.fullmatch(body):
        shown = files.short(text if len(data) <= JOB_ID_MAX_BYTES else text + "...", 40)
        return Diagnostic(
            "jobs.job-id-file",
            f"{id_file} holds {shown}, not a Slurm job id",
            file=str(id_file),
            help=help,
        )
    return body


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


def describe(ref: JobRef) -> tuple[str, list[Diagnostic]]:
    """A few lines: state, time, nodes, restarts, where the logs are, the first failure, the
    attempts; and the diagnostics of the run directory's damaged files."""
    from rlflow.launch import local, monitor
    from rlflow.launch.runfiles import read_run

    if ref.local:
        return local.describe(ref.run_dir)
    run = read_run(ref.run_dir) if ref.run_dir is not None else None
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
    if run is None:
        return "\n".join(lines), []
    lines += [
        f"  run dir: {ref.run_dir}",
        f"  logs:    {files.rank_log(ref.run_dir / files.LOGS, 0)} (rank 0), "
        f"{files.batch_log(ref.run_dir / files.LOGS, ref.job_id)} (batch script)",
    ]
    lines += [f"  server:  {line}" for line in monitor.server_lines(run)]
    lines += [f"  failure: attempt-{n}: {f.message}" for n, f in run.failures if f.message]
    lines += monitor.attempt_records(run.attempts)
    return "\n".join(lines), run.problems


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
    if os.path.lexists(ref.run_dir / "sweep.json"):
        raise RlflowError(
            Diagnostic(
                "jobs.sweep-dir",
                f"{ref.run_dir} is a sweep: each element has its own logs",
                help="pass an element's directory (SWEEP_DIR/<element>) or its job id "
                "(ARRAY_INDEX, listed by `rlflow status SWEEP_DIR`)",
            )
        )
    logs = ref.run_dir / files.LOGS
    if batch and ref.local:
        raise RlflowError(
            Diagnostic(
                "jobs.no-batch-log",
                f"{ref.run_dir} is a local run (`rlflow train --nproc`): it has no batch script, "
                "and its launcher wrote to the terminal it ran in",
                help="drop --batch: `rlflow logs RUN_DIR --rank N` prints a rank's log",
            )
        )
    path = files.batch_log(logs, ref.job_id) if batch else files.rank_log(logs, rank)
    if os.path.lexists(path) and not path.is_file():
        raise RlflowError(
            Diagnostic(
                "jobs.log-not-a-file",
                f"{path} is not a file (a directory or another kind of file is in its place)",
                file=str(path),
                help="move it aside: the launcher writes each rank's log there",
            )
        )
    return path


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
        with bounded.open_regular(path) as log:
            while chunk := log.read(1 << 20):
                sys.stdout.buffer.write(chunk)
    except OSError as err:
        raise RlflowError(
            Diagnostic("jobs.log-unreadable", f"cannot read {path}: {err.strerror or err}"),
            EXIT_FINDINGS,
        ) from None
    sys.stdout.flush()


def follow(path: Path, ref: JobRef) -> bool:
    """Print `path` as it grows until the job (or local run) has ended; whether it completed."""
    position = 0
    last_check = 0.0
    while True:
        position = _print_new(path, position)
        if time.monotonic() - last_check >= FOLLOW_STATE_SECONDS:
            last_check = time.monotonic()
            state, completed = _end_state(ref)
            if state is not None:
                time.sleep(FOLLOW_READ_SECONDS)  # the last lines may still be on their way
                _print_new(path, position)
                what = f"local run {ref.run_dir.name}" if ref.local else f"job {ref.job_id}"
                print(f"rlflow: {what} ended: {state}", file=sys.stderr)
                return completed
        time.sleep(FOLLOW_READ_SECONDS)


def _end_state(ref: JobRef) -> tuple[str | None, bool]:
    """(the final state, whether it completed), or (None, False) while it runs."""
    if ref.local:
        from rlflow.launch import local

        state = local.read(ref.run_dir)[0]
        return (state.state, state.state == "FINISHED") if state.ended else (None, False)
    state = slurm.job_state(ref.job_id)
    if state is None or state in slurm.FINAL_STATES:
        return state or "UNKNOWN", state == "COMPLETED"
    return None, False


def _print_new(path: Path, position: int) -> int:
    try:
        with bounded.open_regular(path) as log:  # a FIFO put there is refused, not waited on
            log.seek(position)
            data = log.read(FOLLOW_READ_BYTES)
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
    if ref.local:
        from rlflow.launch import local

        return local.cancel(ref.run_dir)
    state = slurm.job_state(ref.job_id)
    if state in slurm.FINAL_STATES:
        return f"job {ref.job_id} has already ended ({state}): nothing to cancel"
    result = slurm.cancel(ref.job_id)
    if result.returncode != 0:
        raise slurm.failed(f"scancel could not cancel job {ref.job_id}", result)
    return f"cancelled job {ref.job_id} (was {state or 'unknown'})"
