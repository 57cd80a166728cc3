"""`rlflow status JOB --watch`: one screen about a job, redrawn until the job ends or Ctrl-C.

The screen is a pure function (`render`) of what Slurm says (scontrol's fields, squeue's start
estimate) and what the run directory holds (heartbeats, metrics.jsonl, attempts.jsonl, failure
records, read by rlflow/launch/runfiles.py), so tests check screens without a cluster; `gather`
collects those, `watch` loops. A local run's screen (rlflow/launch/local.py) has the launcher's
state where a job's has the queue, and the same lines below it. Standard library only: it runs
on login nodes (no torch, no curses).
"""

from __future__ import annotations

import math
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlflow import slurm
from rlflow.errors import EXIT_FINDINGS, EXIT_OK, Diagnostic, RlflowError
from rlflow.launch.runfiles import RunFiles, read_run

__all__ = ["JobView", "RunFiles", "read_run", "render", "watch", "watch_sweep", "loop"]

DEFAULT_INTERVAL_SECONDS = 2.0
EXIT_INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C
RECENT_STEPS = 10  # step times are medians over this many of the newest steps
# Per-step timings in metrics.jsonl that are not a phase of the step (tokens_per_second: runs
# from before the speed/ metrics).
NOT_PHASES = {"time/step", "time/tokens_per_second"}
# The step's throughput: prompt + response tokens of all rollouts on all ranks / step time.
STEP_SPEED = "speed/step_tokens_per_s"
# Terminal control: the alternate screen keeps the user's scrollback; the cursor is hidden while
# redrawing. Both are undone on every way out (job end, Ctrl-C, an error).
ENTER_SCREEN, LEAVE_SCREEN = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"
HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


@dataclass(frozen=True)
class JobView:
    """What Slurm says about the job, in scontrol's field names."""

    job_id: str
    fields: dict[str, str]  # JobState, JobName, RunTime, TimeLimit, NodeList, Reason, Restarts
    start_estimate: str | None = None  # squeue --start's START_TIME of a pending job

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "UNKNOWN").split()[0]


# --- the screen ---------------------------------------------------------------------------------


def render(job: JobView, run: RunFiles | None, now: float) -> list[str]:
    """The screen's lines (without terminal codes); `now` is wall-clock time (time.time())."""
    name = job.fields.get("JobName", "?")
    lines = [f"job {job.job_id} ({name})", f"queue:      {_queue(job)}"]
    if run is None:
        lines.append("run dir:    not found (pass the run directory to see the run's progress)")
        return lines
    return lines + body(run, now, job.fields.get("Restarts", "0"))


def body(run: RunFiles, now: float, restarts: str = "0") -> list[str]:
    """The screen below the queue (or a local run's launcher line): the run directory's view."""
    recent = [r for r in run.metrics if "time/step" in r][-RECENT_STEPS:]
    return [
        f"run dir:    {run.path}",
        f"phase:      {phase_text(run, now)}",
        f"speed:      {_speed(recent)}",
        f"step time:  {_phases(recent)}",
        f"ETA:        {_eta(run, recent)}",
        f"rewards:    {_rewards(run.metrics)}",
        *_attempt_lines(run, restarts),
        *[f"server:     {line}" for line in server_lines(run)],
        f"last error: {_last_error(run) or 'none'}",
    ]


def server_lines(run: RunFiles) -> list[str]:
    """One line per generation rank's server (generation.server.enabled; RUN_DIR/servers)."""
    lines = []
    for r in run.servers:
        version = "" if r.weight_version is None else f", weight version {r.weight_version}"
        error = f": {r.error}" if r.error else ""
        lines.append(f"rank {r.rank} {r.url or '(no URL yet)'} ({r.state}{version}){error}")
    return lines


def _queue(job: JobView) -> str:
    f = job.fields
    state = job.state
    if state == "PENDING":
        reason = f.get("Reason", "None")
        start = job.start_estimate
        when = (
            f"estimated start {start} (squeue --start)"
            if start and start not in ("N/A", "Unknown")
            else "no start estimate yet (squeue --start: N/A)"
        )
        return f"PENDING ({reason}), {when}"
    text = f"{state}, {f.get('RunTime', '?')} of {f.get('TimeLimit', '?')}"
    nodes = f.get("NodeList", "")
    if nodes and nodes != "(null)":
        text += f" on {nodes}"
    if state not in ("RUNNING", "COMPLETED") and f.get("Reason", "None") != "None":
        text += f" ({f['Reason']})"
    return text


def phase_text(run: RunFiles, now: float) -> str:
    if not run.beats:
        return "not started (no heartbeat yet)"
    head = min(run.beats, key=lambda b: b["rank"])  # rank 0 where it reported
    step = head["step"]
    total = f" of {run.max_steps}" if run.max_steps else ""
    ages = [now - b["wall"] for b in run.beats if "wall" in b]
    text = f"{head['phase']}, step {step}{total} (attempt {run.attempt}"
    text += f", {len(run.beats)} rank{'s' * (len(run.beats) != 1)} reporting"
    if ages:
        text += f", oldest report {max(0.0, max(ages)):.0f} s ago"
    steps = {b["step"] for b in run.beats}
    if len(steps) > 1:
        text += f", ranks at steps {min(steps)}-{max(steps)}"
    return text + ")"


def _speed(recent: list[dict]) -> str:
    tokens = [r[STEP_SPEED] for r in recent if STEP_SPEED in r]
    if not recent:
        return "no step logged yet"
    last = recent[-1]
    text = f"{_median(tokens):,.0f} tokens/s per step" if tokens else "tokens/s not logged"
    return text + f" (median of the last {len(recent)} steps; newest step {last['step']})"


def _phases(recent: list[dict]) -> str:
    if not recent:
        return "-"
    keys = sorted(
        {k for r in recent for k in r if k.startswith("time/") and k not in NOT_PHASES},
        key=lambda k: (-_median([r[k] for r in recent if k in r]), k),  # slowest first
    )
    parts = [
        f"{k.removeprefix('time/')} {_median([r[k] for r in recent if k in r]):.2f}" for k in keys
    ]
    step = _median([r["time/step"] for r in recent])
    return f"{step:.2f} s" + (f" = {', '.join(parts)}" if parts else "")


def _eta(run: RunFiles, recent: list[dict]) -> str:
    if not run.max_steps:
        return "unknown (no grpo.max_num_steps in the run's recipe.yaml)"
    done = max([r["step"] for r in run.metrics if "time/step" in r], default=0)
    left = max(0, run.max_steps - done)
    if left == 0:
        return f"all {run.max_steps} steps done"
    if not recent:
        return f"{left} steps to go (no step time yet)"
    seconds = left * _median([r["time/step"] for r in recent])
    return f"{duration(seconds)} ({left} steps x median step time, to grpo.max_num_steps={run.max_steps})"


def _rewards(metrics: list[dict]) -> str:
    parts = []
    train = [r for r in metrics if "train/reward" in r]
    if train:
        last = train[-1]
        parts.append(f"train reward {last['train/reward']:.3f}")
        if "train/accuracy" in last:
            parts.append(f"accuracy {last['train/accuracy']:.2f} (step {last['step']})")
    val = [r for r in metrics if "val/accuracy" in r]
    if val:
        parts.append(f"validation accuracy {val[-1]['val/accuracy']:.3f} (step {val[-1]['step']})")
    return ", ".join(parts) or "-"


def _attempt_lines(run: RunFiles, restarts: str) -> list[str]:
    records = run.attempts
    requeues = sum(1 for r in records if r["outcome"] == "time-limit")
    retries = sum(1 for r in records if r["outcome"] == "node-failure")
    stops = sum(1 for r in records if r["outcome"] == "stopped")  # a local run's
    current = run.attempt if run.attempt is not None else restarts
    lines = [
        f"attempts:   now attempt {current}; {requeues} time-limit requeue"
        f"{'s' * (requeues != 1)}, {retries} node-failure retr{'ies' if retries != 1 else 'y'}"
        + (f", {stops} stopped by a signal" if stops else "")
    ]
    for r in records[-3:]:
        step = "-" if r.get("step") is None else r["step"]
        lines.append(
            f"  {r['attempt']}: {r['outcome']} at step {step} on {r['nodes']} -> {r['action']}"
        )
    return lines


def _last_error(run: RunFiles) -> str | None:
    if run.failure:
        return run.failure
    for r in reversed(run.attempts):
        if r["outcome"] not in ("completed", "time-limit", "stopped"):
            return f"attempt {r['attempt']}: {r['reason']}"
    return None


def attempt_records(records: list[dict]) -> list[str]:
    """`rlflow status`'s lines for attempts.jsonl: one per attempt, then the final word."""
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


def progress_text(run: RunFiles) -> str:
    """One line for `rlflow status`: the newest step logged, its reward, the last validation."""
    steps = [r for r in run.metrics if "time/step" in r or "train/reward" in r]
    if not steps:
        return "no step logged yet"
    total = f" of {run.max_steps}" if run.max_steps else ""
    return f"step {steps[-1]['step']}{total} logged; {_rewards(run.metrics)}"


def _median(values: list[float]) -> float:
    import statistics  # here: fractions and decimal (~5 ms) for --watch's screen only

    return statistics.median(values) if values else 0.0


def duration(seconds: float) -> str:
    """H:MM:SS, like Slurm's RunTime."""
    if not math.isfinite(seconds) or abs(seconds) > 1e9:
        return "?"
    hours, rest = divmod(int(round(seconds)), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


# --- reading the cluster and the run directory ---------------------------------------------------


def gather(job_id: str, run_dir: Path | None) -> JobView | None:
    """Slurm's view of the job (scontrol, then sacct once it is gone); None if Slurm has none."""
    fields = slurm.job_fields(job_id)
    if fields is None:
        record = slurm.accounting(job_id)
        if record is None:
            return None
        fields = {
            "JobState": record["State"],
            "JobName": record["JobName"],
            "RunTime": record["Elapsed"],
            "TimeLimit": record["Timelimit"],
            "NodeList": record["NodeList"],
        }
    estimate = slurm.start_estimate(job_id) if fields.get("JobState") == "PENDING" else None
    return JobView(job_id, fields, estimate)


# --- the loop -----------------------------------------------------------------------------------


def watch(job_id: str, run_dir: Path | None, interval: float, out=None) -> int:
    """Redraw the job's screen every `interval` seconds until the job ends (exit 0 if it
    completed, 1 otherwise) or Ctrl-C (exit 130). The terminal is restored on every way out."""

    def screen() -> tuple[list[str], str | None]:
        job = gather(job_id, run_dir)
        if job is None:
            raise RlflowError(
                Diagnostic(
                    "jobs.not-found",
                    f"Slurm knows no job {job_id} (neither scontrol nor sacct)",
                    help="check the id; SLURM_CONF picks the cluster",
                ),
                EXIT_FINDINGS,
            )
        run = read_run(run_dir) if run_dir is not None else None
        if run is not None and run.problems:
            raise RlflowError(run.problems)  # a damaged file is named, not half shown
        ended = job.state if job.state in slurm.FINAL_STATES else None
        return render(job, run, time.time()), ended

    return loop(screen, interval, f"job {job_id}", out)


def watch_sweep(sweep_dir: Path, interval: float, out=None) -> int:
    """The sweep's screen (one line per element, rlflow/launch/sweep_jobs.py) until every
    element has ended (exit 0 if all completed) or Ctrl-C (exit 130)."""
    from rlflow.launch import sweep_jobs

    def screen() -> tuple[list[str], str | None]:
        # One query of the states for both the screen and the decision: a task that ends
        # between two queries would otherwise end the monitor on a screen that says RUNNING.
        manifest = sweep_jobs.manifest(sweep_dir)
        states = sweep_jobs.task_states(manifest["array_job_id"])
        text, problems = sweep_jobs.describe(sweep_dir, states, manifest)
        if problems:
            raise RlflowError(problems)
        lines = text.splitlines()
        elements = [states.get(e["index"], "UNKNOWN") for e in manifest["elements"]]
        if not all(state in slurm.FINAL_STATES for state in elements):
            return lines, None
        return lines, "COMPLETED" if set(elements) == {"COMPLETED"} else "not all COMPLETED"

    return loop(screen, interval, f"sweep {sweep_dir.name}", out)


def loop(screen, interval: float, what: str, out=None, success: str = "COMPLETED") -> int:
    """Draw `screen()` -> (lines, final state or None) every `interval` seconds; exit 0 when
    the final state is `success`."""
    out = out or sys.stdout
    tty = out.isatty()
    lines: list[str] = []
    ended: str | None = None
    interrupted = False
    stopped_by: list[int] = []

    def leave(signum, _frame):  # SIGTERM, or SIGHUP (terminal closed): leave like Ctrl-C does
        stopped_by.append(signum)
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, leave) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C leaves even where SIGINT came ignored: a shell without job control starts its
    # background jobs so, and Python then keeps it ignored (the trainer does the same).
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    if tty:
        out.write(ENTER_SCREEN)
    try:
        while True:
            lines, ended = screen()
            stamp = time.strftime("%H:%M:%S")
            header = f"rlflow monitor, {stamp}, every {interval:g} s (Ctrl-C leaves; {what} keeps running)"
            _draw(out, [header, *lines], tty)
            if ended is not None:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if not interrupted:  # (after Ctrl-C it stays ignored: the cleanup must not be cut)
            signal.signal(signal.SIGINT, previous_int)
        if tty:
            try:
                out.write(LEAVE_SCREEN)
                out.write("\n".join(lines) + "\n")  # the last screen stays in the scrollback
                out.flush()
            except OSError:  # the terminal is gone (SIGHUP): nothing left to restore
                pass
    if interrupted:
        try:
            print(f"rlflow: left the monitor; {what} keeps running", file=sys.stderr)
        except OSError:
            pass
        return 128 + stopped_by[0] if stopped_by else EXIT_INTERRUPTED
    print(f"rlflow: {what} ended: {ended}", file=sys.stderr)
    return EXIT_OK if ended == success else EXIT_FINDINGS


def _draw(out, lines: list[str], tty: bool) -> None:
    if not tty:
        out.write("\n".join(lines) + "\n\n")
        out.flush()
        return
    width = max(20, shutil.get_terminal_size().columns)
    out.write(HOME + "".join(line[:width] + CLEAR_LINE + "\r\n" for line in lines) + CLEAR_BELOW)
    out.flush()
