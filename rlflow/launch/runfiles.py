"""What a run directory holds, read for `rlflow status`, `--watch` and `logs`: every file checked.

The run directory's files (rlflow/job/files.py names them) are written by other processes on
other machines, and a person may have edited or damaged any of them. Each is read here once,
strictly: a file that is not what its writer writes (not UTF-8, not JSON, a key missing or of
the wrong type, a directory where a file belongs) becomes a diagnostic naming the file, the
line or the key, and what to do, and is left out of what the commands show. Only the torn last
line of a JSON lines file (a write in progress) is skipped silently. The commands show what
they could read, then the diagnostics, and exit 2.

Standard library only: this runs on login nodes.
"""

from __future__ import annotations

import errno
import json
import math
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from rlflow import bounded
from rlflow.errors import Diagnostic, RlflowError
from rlflow.job import files
from rlflow.serve import registry
from rlflow.serve.registry import ServerRecord

METRICS_TAIL_BYTES = 256 * 1024  # recent steps only: metrics.jsonl grows by ~1.5 kB a step
MAX_RECORD_BYTES = files.RECORD_MAX_BYTES  # a heartbeat, a failure record, launcher.json
MAX_FILE_BYTES = files.FILE_MAX_BYTES  # attempts.jsonl, recipe.yaml
OUTCOMES = ("completed", "time-limit", "node-failure", "failed", "stopped")
_RANK_FILE = re.compile(r"rank-(\d{1,9})\.json")
_MAX_STEPS = re.compile(rb"^grpo:\n(?:  .*\n)*?  max_num_steps: (\d{1,18})$", re.M)

HELP = {
    files.ATTEMPTS: "the batch script (or `rlflow train --nproc`) appends one line per attempt "
    "there; fix or delete the damaged line (the other lines stay valid)",
    files.METRICS: "the trainer appends one line per step there; delete the damaged line "
    "(the other steps were logged fine)",
    files.HEARTBEAT: "a running rank replaces its heartbeat file every phase; delete the damaged "
    "file (a rank that still runs writes a new one)",
    "failure": "the node launcher writes this record when a rank fails; move the damaged one "
    "aside (its rank log says what happened)",
    files.LAUNCHER: "`rlflow train --nproc` writes it when it starts; if no run is going on, "
    "delete it (the next `rlflow train` writes a new one)",
    files.RECIPE: "the resolved recipe the ranks train; restore it (the dry run prints it), or "
    "delete it (the steps to go are then unknown)",
    files.RESOLVED_RECIPE: "rank 0 writes the recipe it resolved there when it starts; delete it "
    "(the next `rlflow train` writes it again)",
    files.STATUS: "the node launchers keep one folder per attempt there; move what is not such "
    "a folder aside",
}


@dataclass
class RunFiles:
    """What the run directory holds, read once per refresh; `problems`: its damaged files."""

    path: Path
    max_steps: int | None = None  # grpo.max_num_steps of the resolved recipe
    attempt: int | None = None  # the newest status/attempt-N
    beats: list[dict] = field(default_factory=list)  # that attempt's heartbeats, with "rank"
    metrics: list[dict] = field(default_factory=list)  # the newest metrics.jsonl records
    attempts: list[dict] = field(default_factory=list)  # attempts.jsonl
    failures: list[tuple[int, files.Failure]] = field(default_factory=list)  # per attempt
    launcher: files.LauncherRecord | None = None  # launcher.json (a local run)
    servers: list[ServerRecord] = field(default_factory=list)  # servers/rank-R.json, by rank
    problems: list[Diagnostic] = field(default_factory=list)

    @property
    def failure(self) -> str | None:
        """The newest attempt's first failure, if it has one."""
        if not self.failures or self.failures[-1][0] != self.attempt:
            return None
        attempt, found = self.failures[-1]
        host = f", {found.host}" if found.host else ""
        return f"attempt {attempt}: {found.message} (exit {found.code}{host})"


def read_run(run_dir: Path) -> RunFiles:
    run = RunFiles(path=run_dir)
    run.max_steps = _max_steps(run, run_dir / files.RECIPE)
    if run.max_steps is None:  # a local run: rank 0's resolved recipe
        run.max_steps = _max_steps(run, run_dir / files.RESOLVED_RECIPE)
    run.attempts = _attempts(run, run_dir / files.ATTEMPTS)
    run.metrics = _metrics(run, run_dir / files.METRICS)
    run.launcher = _launcher(run, run_dir / files.LAUNCHER)
    try:
        run.servers = registry.read_all(run_dir)
    except RlflowError as err:  # a damaged record: reported with the other damaged files
        run.problems += err.diagnostics
    folders = _attempt_dirs(run, run_dir)
    for folder in folders:
        found = _failure(run, folder)
        if found is not None:
            run.failures.append((files.attempt_of(folder), found))
    if folders:
        run.attempt = files.attempt_of(folders[-1])
        run.beats = _beats(run, folders[-1] / files.HEARTBEAT)
    return run


# --- one reader per file ------------------------------------------------------------------------


def damaged(path: Path, what: str, kind: str, line: int | None = None) -> Diagnostic:
    """A damaged file, named with the line (when it is one) and what to do (HELP[kind])."""
    return Diagnostic(
        "jobs.damaged-file",
        f"{path}{f' line {line}' if line else ''}: {what}",
        file=str(path),
        help=HELP[kind],
    )


def read_bytes(path: Path, limit: int, kind: str, problems: list[Diagnostic]) -> bytes | None:
    """A regular file's bytes (rlflow/bounded.py: no FIFO, device, or more than `limit`);
    None (and a problem, unless it is simply absent) otherwise."""
    try:
        return bounded.read_bytes(path, limit)
    except FileNotFoundError:
        return None
    except bounded.UnreadableFile as err:
        what = str(err).removeprefix("it ")
        if err.errno == errno.EISDIR:
            what = what.replace(", not a regular file", ", where rlflow keeps a file")
        problems.append(damaged(path, what, kind))
        return None
    except OSError as err:
        problems.append(damaged(path, f"cannot be read: {err.strerror or err}", kind))
        return None


def _max_steps(run: RunFiles, recipe: Path) -> int | None:
    """grpo.max_num_steps, read as rlflow writes the resolved recipe (no YAML parser: fast)."""
    data = read_bytes(recipe, MAX_FILE_BYTES, recipe.name, run.problems)
    match = _MAX_STEPS.search(data) if data else None
    return int(match[1]) if match else None


def _jsonl(run: RunFiles, path: Path, data: bytes, kind: str, first_line: int = 1) -> list:
    values, bad = files.read_jsonl(data)
    for number, what in bad:
        run.problems.append(damaged(path, what, kind, line=number + first_line - 1))
    return [(number + first_line - 1, value) for number, value in values]


def _attempts(run: RunFiles, path: Path) -> list[dict]:
    data = read_bytes(path, MAX_FILE_BYTES, files.ATTEMPTS, run.problems)
    return _checked_records(run, path, data or b"", files.ATTEMPTS, _attempt_problem)


def _checked_records(run: RunFiles, path: Path, data: bytes, name: str, problem_of, first_line=1):
    """The file's JSON lines that `problem_of` finds nothing wrong with; each damaged one is a
    problem of `run`, at its line."""
    records = []
    for line, record in _jsonl(run, path, data, name, first_line):
        problem = problem_of(record)
        if problem:
            run.problems.append(damaged(path, problem, name, line=line))
        else:
            records.append(_clean(record))
    return records


def _attempt_problem(record: object) -> str | None:
    """What is wrong with one attempts.jsonl record (rlflow/job/attempts.py's Attempt)."""
    if not isinstance(record, dict):
        return f"a JSON object was expected, not {_kind(record)}"
    checks = {
        "attempt": (_count, "an attempt number"),
        "outcome": (lambda v: v in OUTCOMES, f"one of {', '.join(OUTCOMES)}"),
        "reason": (_text, "a string"),
        "nodes": (_text, "a string"),
        "action": (_text, "a string"),
        "exit_code": (_integer, "an exit code"),
    }
    optional = {
        "step": (lambda v: v is None or _count(v), "a step or null"),
        "checkpoint_step": (lambda v: v is None or _count(v), "a step or null"),
        "excluded": (_texts, "a list of node names"),
    }
    for key, (check, expected) in {**checks, **optional}.items():
        if key not in record:
            if key in checks:
                return f"key `{key}` is missing"
        elif not check(record[key]):
            return f"key `{key}` is {files.short(record[key])}, not {expected}"
    return None


def _metrics(run: RunFiles, path: Path) -> list[dict]:
    """The JSON lines in the file's last METRICS_TAIL_BYTES (a partial first line skipped)."""
    try:
        info = path.stat()
    except OSError:
        info = None
    if info is not None and stat.S_ISREG(info.st_mode) and info.st_size > METRICS_TAIL_BYTES:
        try:
            with bounded.open_regular(path) as handle:
                handle.seek(info.st_size - METRICS_TAIL_BYTES)
                data = bounded.read_stream(handle, path, METRICS_TAIL_BYTES)
        except OSError as err:
            run.problems.append(damaged(path, f"cannot be read: {err}", files.METRICS))
            return []
        cut = data.find(b"\n") + 1  # the first line is cut
        first_line = _line_of(path, info.st_size - METRICS_TAIL_BYTES + cut)
        data = data[cut:]
    else:
        data = read_bytes(path, METRICS_TAIL_BYTES, files.METRICS, run.problems) or b""
        first_line = 1
    return _checked_records(run, path, data, files.METRICS, _metrics_problem, first_line)


def _metrics_problem(record: object) -> str | None:
    """A metrics record is {"step": N, "<name>": value, ...}; what status reads are numbers."""
    if not isinstance(record, dict):
        return f"a JSON object was expected, not {_kind(record)}"
    if "step" not in record:
        return "key `step` is missing"
    if not _count(record["step"]):
        return f"key `step` is {files.short(record['step'])}, not a step number"
    for key, value in record.items():
        shown = key.startswith("time/") or key in ("train/reward", "train/accuracy")
        if (shown or key == "val/accuracy") and not _number(value):
            return f"key `{key}` is {files.short(value)}, not a number"
    return None


def _line_of(path: Path, offset: int) -> int:
    """The line number at byte `offset` (counted only when a tail is read)."""
    count = 1
    try:
        with bounded.open_regular(path) as handle:
            while offset > 0:
                chunk = handle.read(min(offset, 1 << 20))
                if not chunk:
                    break
                count += chunk.count(b"\n")
                offset -= len(chunk)
    except OSError:
        pass
    return count


def _launcher(run: RunFiles, path: Path) -> files.LauncherRecord | None:
    data = read_bytes(path, MAX_RECORD_BYTES, files.LAUNCHER, run.problems)
    if data is None:
        return None
    try:
        return files.LauncherRecord.parse(json.loads(data.decode("utf-8")))
    except UnicodeDecodeError:
        run.problems.append(damaged(path, "not UTF-8 text", files.LAUNCHER))
    except (ValueError, RecursionError) as err:
        run.problems.append(damaged(path, f"not a launcher record: {err}", files.LAUNCHER))
    return None


def _attempt_dirs(run: RunFiles, run_dir: Path) -> list[Path]:
    status = run_dir / files.STATUS
    try:
        entries = list(status.iterdir())
    except FileNotFoundError:
        return []
    except OSError as err:  # a file where the folder belongs, or no permission
        what = "is a file" if status.is_file() else f"cannot be read ({err.strerror or err})"
        run.problems.append(damaged(status, f"{what}, where the status folders belong", "status"))
        return []
    for entry in entries:
        if files.attempt_of(entry) is not None and not entry.is_dir():
            run.problems.append(damaged(entry, "is a file, where a folder belongs", "status"))
    return files.attempt_dirs(run_dir)


def _failure(run: RunFiles, attempt: Path) -> files.Failure | None:
    """The attempt's first failure (or its peer failure, if that is all there is)."""
    for name in (files.FIRST_FAILURE, files.PEER_FAILURE):
        data = read_bytes(attempt / name, MAX_RECORD_BYTES, "failure", run.problems)
        if data is None:
            continue
        lines = data.decode("utf-8", "replace").splitlines() + ["", "", ""]
        if not re.fullmatch(r"-?\d{1,6}", lines[0].strip()):
            problem = f"line 1 is {files.short(lines[0])}, not an exit code"
            run.problems.append(damaged(attempt / name, problem, "failure", line=1))
            continue
        return files.Failure(lines[0].strip(), _printable(lines[1]), _printable(lines[2]))
    return None


def _beats(run: RunFiles, folder: Path) -> list[dict]:
    beats = []
    try:
        paths = sorted(folder.glob("rank-*.json"))
    except OSError:
        return []
    for path in paths:
        match = _RANK_FILE.fullmatch(path.name)
        if match is None:
            continue  # not a rank's report (a rank writes rank-<R>.json)
        data = read_bytes(path, MAX_RECORD_BYTES, files.HEARTBEAT, run.problems)
        if data is None:
            continue  # replaced while listed (a rank writes it atomically), or damaged
        try:
            beat = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            run.problems.append(damaged(path, "not a JSON heartbeat", files.HEARTBEAT))
            continue
        problem = _beat_problem(beat)
        if problem:
            run.problems.append(damaged(path, problem, files.HEARTBEAT))
            continue
        beats.append({**_clean(beat), "rank": int(match[1])})
    return beats


def _beat_problem(beat: object) -> str | None:
    """A heartbeat is rlflow/train/watchdog.py's record: phase, step, time and wall clock."""
    if not isinstance(beat, dict):
        return f"a JSON object was expected, not {_kind(beat)}"
    checks = {"phase": (_text, "a string"), "step": (_count, "a step number")}
    for key, (check, expected) in checks.items():
        if key not in beat:
            return f"key `{key}` is missing"
        if not check(beat[key]):
            return f"key `{key}` is {files.short(beat[key])}, not {expected}"
    if "wall" in beat and not _finite(beat["wall"]):
        return f"key `wall` is {files.short(beat['wall'])}, not a time"
    return None


# --- value checks -------------------------------------------------------------------------------


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: object) -> bool:
    """A step or attempt number: a non-negative integer any clock or counter could reach."""
    return _integer(value) and 0 <= value < 2**63


def _number(value: object) -> bool:
    """A number (NaN and infinity included: a metric may be either)."""
    return isinstance(value, float) or (_integer(value) and abs(value) < 2**63)


def _finite(value: object) -> bool:
    return _number(value) and math.isfinite(value)


def _text(value: object) -> bool:
    return isinstance(value, str)


def _texts(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _kind(value: object) -> str:
    return {list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(
        type(value), "a number"
    )


def _clean(record: dict) -> dict:
    """A record's keys and strings (and lists of strings) made safe to print."""

    def clean(value):
        if isinstance(value, str):
            return _printable(value)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return [_printable(v) for v in value]
        return value

    return {_printable(k): clean(v) for k, v in record.items()}


def _printable(text: str) -> str:
    """A line for the terminal: control characters (escape sequences) shown, not sent."""
    if text.isprintable():  # nearly always: a metric's name (status reads ~12,000 of them)
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
