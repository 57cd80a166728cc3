"""A local run (`rlflow train --nproc N` on this machine), as `rlflow status`, `--watch`, `logs`
and `cancel` see it: no Slurm, only the run directory and the live process.

The launcher records itself in RUN_DIR/launcher.json when it starts (pid, start time, boot,
host, attempt, the command line) and appends its attempt's outcome to attempts.jsonl when it
ends (rlflow/job/local.py). So a run is:

    RUNNING    its launcher's process is alive (the same pid *and* start time)
    FINISHED   its newest attempt completed
    STOPPED    its newest attempt stopped on a signal (saved, or not): the same command resumes
    FAILED     its newest attempt failed: the root cause is the first failure
    GONE       the launcher is dead without a record of its end (SIGKILL, out of memory, a
               reboot): the same command resumes from the newest checkpoint
    UNKNOWN    it ran on another host: this machine cannot see its process
    UNTRACKED  no launcher record (`rlflow train` without --nproc): only its files are shown
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from rlflow.errors import EXIT_FINDINGS, Diagnostic, RlflowError
from rlflow.job import files
from rlflow.launch.runfiles import RunFiles, read_run

FINAL = ("FINISHED", "STOPPED", "FAILED", "GONE", "UNTRACKED")  # nothing more will happen


@dataclass(frozen=True)
class LocalState:
    state: str  # RUNNING FINISHED STOPPED FAILED GONE UNKNOWN UNTRACKED
    detail: str  # one line: since when, where, why it ended
    resume: str | None = None  # how to continue it, when it can be continued

    @property
    def ended(self) -> bool:
        return self.state in FINAL


def is_local_run(path: Path) -> bool:
    """A run directory `rlflow train` wrote, without a Slurm job (or newer than its job)."""
    launcher, job_id = path / files.LAUNCHER, path / files.JOB_ID
    if launcher.exists():
        return not job_id.exists() or _mtime(launcher) >= _mtime(job_id)
    if job_id.exists():
        return False
    return any(
        (path / name).exists()
        for name in (files.METRICS, files.RESOLVED_RECIPE, files.STATUS, files.CHECKPOINTS)
    )


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def read(run_dir: Path) -> tuple[LocalState, RunFiles]:
    """The run's state and files. The process is looked at before the files are read: a
    launcher that ends in between has written its record by the time the files are read."""
    alive = _alive(run_dir)
    run = read_run(run_dir)
    return state_of(run, alive), run


def _alive(run_dir: Path) -> bool | None:
    record = files.read_launcher(run_dir)  # None: none, or damaged (read_run names the damage)
    return None if record is None else files.launcher_running(record)


def state_of(run: RunFiles, alive: bool | None) -> LocalState:
    record = run.launcher
    if record is None:
        if run.attempts and run.attempts[-1].get("job_id", "") == "":
            return _ended(run, run.attempts[-1], None)
        return LocalState(
            "UNTRACKED",
            f"no launcher record ({files.LAUNCHER}): started by `rlflow train` without --nproc "
            "(one process), or by an older rlflow; its files are shown",
        )
    ended = next((r for r in reversed(run.attempts) if r["attempt"] == record.attempt), None)
    if ended is not None:
        return _ended(run, ended, record)
    since = f"since {_clock(record.started)} ({_duration(time.time() - record.started)})"
    who = f"launcher pid {record.pid} on {record.host}, {record.nproc} ranks"
    if alive:
        return LocalState("RUNNING", f"attempt {record.attempt}, {since}; {who}")
    if alive is None:
        return LocalState(
            "UNKNOWN",
            f"attempt {record.attempt} started {_clock(record.started)} on {record.host}: "
            "this machine cannot see that host's processes; run `rlflow status` there",
        )
    return LocalState(
        "GONE",
        f"attempt {record.attempt}'s launcher (pid {record.pid}, started "
        f"{_clock(record.started)}) is gone without recording an end: it was killed (SIGKILL, "
        "out of memory) or the machine rebooted",
        _resume(run, record),
    )


def _ended(run: RunFiles, last: dict, record: files.LauncherRecord | None) -> LocalState:
    outcome, attempt = last["outcome"], last["attempt"]
    ended = f" at {last['ended']}" if isinstance(last.get("ended"), str) and last["ended"] else ""
    if outcome == "completed":
        return LocalState("FINISHED", f"attempt {attempt} completed{ended}")
    if outcome in ("stopped", "time-limit"):
        detail = f"attempt {attempt} {last['reason']}{ended}"
        return LocalState("STOPPED", detail, _resume(run, record))
    return LocalState(
        "FAILED",
        f"attempt {attempt} failed with exit code {last['exit_code']}{ended}: {last['reason']}",
        _resume(run, record),
    )


def _resume(run: RunFiles, record: files.LauncherRecord | None) -> str:
    step = files.checkpoint_step(run.path)
    where = f"from checkpoint step {step}" if step is not None else "from the start (no checkpoint)"
    if record is None:
        return f"the command that started it continues {where}"
    return f"`{command_text(record)}` (in {record.cwd}) continues {where}"


def command_text(record: files.LauncherRecord) -> str:
    """The launcher's command line as the user typed it (the console script by its name)."""
    argv = list(record.command)
    if Path(argv[0]).name == "rlflow":
        argv[0] = "rlflow"
    return shlex.join(argv)


def describe(run_dir: Path) -> tuple[str, list[Diagnostic]]:
    """`rlflow status RUN_DIR` of a local run: a few lines, and the damaged files' diagnostics."""
    from rlflow.launch import monitor

    state, run = read(run_dir)
    record = run.launcher
    lines = [f"local run {run_dir.name}: {state.state}, {state.detail}"]
    if record is not None:
        lines.append(f"  command: {command_text(record)}")
    lines += [
        f"  run dir: {run_dir}",
        f"  logs:    {files.rank_log(run_dir / files.LOGS, 0)} (rank 0)",
    ]
    if state.state == "RUNNING":
        lines.append(f"  phase:   {monitor.phase_text(run, time.time())}")
    lines.append(f"  metrics: {monitor.progress_text(run)}")
    lines += [f"  server:  {line}" for line in monitor.server_lines(run)]
    lines += [f"  failure: attempt-{n}: {f.message}" for n, f in run.failures if f.message]
    lines += monitor.attempt_records(run.attempts)
    if state.resume:
        lines.append(f"  resume:  {state.resume}")
    return "\n".join(lines), run.problems


def screen_head(run_dir: Path) -> tuple[list[str], RunFiles, LocalState]:
    """The monitor's first lines for a local run (in place of the queue)."""
    state, run = read(run_dir)
    lines = [f"local run {run_dir.name}", f"launcher:   {state.state}, {state.detail}"]
    if state.resume:
        lines.append(f"resume:     {state.resume}")
    return lines, run, state


def cancel(run_dir: Path) -> str:
    """SIGTERM to a running launcher, which asks its ranks to save and stop (exit 75). Only a
    launcher whose pid and start time match its record is signalled, through a pidfd: a pid
    reused by another process is never signalled."""
    state, run = read(run_dir)
    record = run.launcher
    if run.problems and any(p.file == str(run_dir / files.LAUNCHER) for p in run.problems):
        raise RlflowError(run.problems)  # never act on a record that was not read whole
    if state.state != "RUNNING" or record is None:
        return f"local run {run_dir.name} is not running ({state.state}): nothing to cancel"
    try:
        handle = os.pidfd_open(record.pid)
    except OSError:
        return f"local run {run_dir.name} has just ended: nothing to cancel"
    try:
        if files.process_start(record.pid) != record.start_ticks:
            return f"local run {run_dir.name} has just ended: nothing to cancel"
        signal.pidfd_send_signal(handle, signal.SIGTERM)
    except OSError as err:
        raise RlflowError(
            Diagnostic(
                "jobs.cancel-local",
                f"cannot signal the launcher (pid {record.pid}): {err.strerror or err}",
                help="it runs as another user: stop it from that account (Ctrl-C in its "
                "terminal, or kill -TERM)",
            ),
            EXIT_FINDINGS,
        ) from None
    finally:
        os.close(handle)
    return (
        f"asked local run {run_dir.name} to stop (SIGTERM to its launcher, pid {record.pid}): "
        "its ranks save a checkpoint at the next step and exit; `rlflow status "
        f"{run_dir}` shows when"
    )


def _clock(wall: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))
    except (OverflowError, OSError, ValueError):
        return "?"


def _duration(seconds: float) -> str:
    from rlflow.launch.monitor import duration

    return duration(seconds)


def watch_local(run_dir: Path, interval: float, out=None) -> int:
    """A local run's screen (`status --watch RUN_DIR`) until its launcher ends: exit 0 if the run
    finished, 1 if it stopped, failed or its launcher is gone; Ctrl-C leaves (130)."""
    from rlflow.launch import monitor

    def screen() -> tuple[list[str], str | None]:
        head, run, state = screen_head(run_dir)
        if run.problems:
            raise RlflowError(run.problems)
        return head + monitor.body(run, time.time()), state.state if state.ended else None

    return monitor.loop(screen, interval, f"local run {run_dir.name}", out, success="FINISHED")
