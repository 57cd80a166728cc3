"""`rlflow train --nproc N`: several ranks on this machine, watched by the same node launcher
that runs them under Slurm (rlflow.job.node), so a failing rank ends the others here too.

A closed terminal (SIGHUP), Ctrl-C (SIGINT) or SIGTERM asks the ranks to save and stop, as the
time-limit warning does under Slurm: they save a checkpoint at the step boundary and exit 75,
and so does `rlflow train`; the same command resumes the run. A second Ctrl-C or SIGTERM stops
the ranks at once, without saving.

Each such command is one attempt of the run, as a requeue is under Slurm: the launcher records
itself in RUN_DIR/launcher.json (pid, start time, the command line) and its attempt's files in
RUN_DIR/status/attempt-<A>/, and appends the attempt's outcome to RUN_DIR/attempts.jsonl, so
`rlflow status RUN_DIR` shows a local run as it shows a Slurm job (rlflow/job/files.py).
"""

from __future__ import annotations

import signal
import socket
import sys
from dataclasses import asdict
from pathlib import Path

from rlflow.errors import EX_TEMPFAIL, Diagnostic, RlflowError
from rlflow.job import files
from rlflow.job.attempts import local_attempt
from rlflow.job.node import Launcher, NodeInfo
from rlflow.job.ranks import detach_output

SAVE_ON = frozenset({signal.SIGHUP, signal.SIGINT, signal.SIGTERM})


def run_local(
    command: list[str],
    nproc: int,
    run_dir: Path,
    *,
    startup_timeout: float | None,
    stop_signal: str,
    resume_command: list[str] | None = None,
) -> int:
    """Start `command` as ranks 0..nproc-1 (rank logs in RUN_DIR/logs); return the exit code:
    75 when the ranks saved and stopped on a time-limit warning, as one rank alone would.

    resume_command: the command line that started this (sys.argv if not given), which
    `rlflow status` shows as the way to resume."""
    run_dir.mkdir(parents=True, exist_ok=True)
    refuse_a_second_launcher(run_dir)
    attempt = files.next_attempt(run_dir)
    status = files.attempt_status(run_dir, attempt)
    record = files.this_launcher(attempt=attempt, nproc=nproc, command=resume_command or sys.argv)
    files.write_launcher(run_dir, record)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    info = NodeInfo(
        node_rank=0,
        num_nodes=1,
        ranks_per_node=nproc,
        hostname=socket.gethostname(),
        master_addr="127.0.0.1",
        master_port=str(port),
    )
    logs = run_dir / files.LOGS
    launcher = Launcher(
        info,
        command,
        logs,
        status,
        stop_grace=60.0,
        startup_timeout=startup_timeout,
        stop_signal=stop_signal,
        save_on=SAVE_ON,
    )
    code = launcher.run()
    ended = local_attempt(
        run_dir,
        status,
        attempt=attempt,
        rc=code,
        host=info.hostname,
        stopped_by=launcher.stopped_by,
    )
    try:
        files.append_attempt(run_dir, asdict(ended))
    except OSError as err:
        info.say(f"cannot record the attempt in {run_dir / files.ATTEMPTS}: {err}", sys.stderr)
    try:
        print(f"rank logs: {logs}/rank-*.log", flush=True)
    except OSError:  # the terminal is gone (SIGHUP): the run's files say it all
        detach_output()
    if code == 0 and any(r.exit_code == EX_TEMPFAIL for r in launcher.ranks.all):
        return EX_TEMPFAIL
    return code


def refuse_a_second_launcher(run_dir: Path) -> None:
    """Two launchers in one run directory would write the same checkpoints: refuse the second."""
    record = files.read_launcher(run_dir)
    if record is None:
        return  # none (or a damaged one, which the new record replaces)
    if files.launcher_running(record):
        raise RlflowError(
            Diagnostic(
                "train.run-dir-in-use",
                f"the run directory {run_dir} is in use: its launcher (pid {record.pid}, "
                f"attempt {record.attempt}) is still running",
                file=str(run_dir / files.LAUNCHER),
                help=f"wait for it (`rlflow status {run_dir} --watch`), stop it "
                f"(`rlflow cancel {run_dir}`: it saves and stops), or pass another --run-dir",
            )
        )
