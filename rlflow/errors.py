"""Diagnostics: what went wrong, where, and how to fix it, rendered like a compiler would.

Every user-facing failure in rlflow (a bad recipe key, a pin drift, an sbatch refusal) becomes
one or more `Diagnostic`s. Commands collect them, print all of them, then a count, and exit
with a code that tells scripts what happened: 0 fine, 1 findings, 2 unusable input.

The job's own exit codes (75-78) are defined here too, once: the trainer, the node launcher,
the retry decision and the sbatch template (a render variable) all read them from this module.
Standard library only: the node launcher imports it on every node.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2

# The job's exit codes (sysexits.h style): what a rank, a node launcher or the batch script ends
# with, and what the batch script's retry decision (rlflow/job/attempts.py) reads back.
EX_TEMPFAIL = 75  # saved and stopped (time-limit warning, SIGTERM): requeue and resume
EX_PEER_FAILED = 76  # stopped because another rank failed: never the root cause
EX_HANG = 77  # the watchdog: a rank made no progress (a node failure, retried without the node)
EX_PREFLIGHT = 78  # this node failed a preflight check (a node failure, retried without it)
JOB_EXIT_CODES = {
    "tempfail": EX_TEMPFAIL,
    "peer_failed": EX_PEER_FAILED,
    "hang": EX_HANG,
    "preflight": EX_PREFLIGHT,
}

# What a diagnostic is about. Logic that must tell diagnostics apart (is this pin drift? does
# every rank see the same error?) reads `category`, never the text of `code`.
CATEGORIES = (
    "recipe",  # a recipe key or a combination of keys
    "allocation",  # the recipe against the job's shape (nodes x GPUs)
    "submit",  # flags, sbatch values, the run directory
    "pins",  # check-pins findings
    "pins-unchecked",  # check-pins could not run (no git repository, no pyproject.toml)
    "data",
    "model",
    "train",
    "checkpoint",
    "reward",
    "other",
)


_FIELDS = ("code", "message", "severity", "file", "line", "column", "help", "notes", "category")


class Diagnostic:
    """One finding. `code` is stable (scripts and docs refer to it); the rest is for humans.

    `category` (see CATEGORIES) defaults to the code's namespace (`recipe.range` -> recipe;
    check-pins' RFnnn -> pins); set it where the namespace says something else.

    A frozen value, like a frozen dataclass (equality, hash, repr by its fields; `replace`
    for a changed copy), written by hand: `dataclasses` and the `inspect` it imports were a
    tenth of `rlflow check-pins`' start-up, which runs on every commit.
    """

    __slots__ = _FIELDS
    __match_args__ = _FIELDS

    code: str
    message: str
    severity: str  # "error" | "warning"
    file: str | None
    line: int | None
    column: int | None
    help: str | None
    notes: tuple[str, ...]
    category: str

    def __init__(
        self,
        code: str,
        message: str,
        severity: str = "error",
        file: str | None = None,
        line: int | None = None,
        column: int | None = None,
        help: str | None = None,  # noqa: A002 (the field's name in JSON and in every caller)
        notes: tuple[str, ...] = (),
        category: str = "",
    ) -> None:
        category = category or _default_category(code)
        assert category in CATEGORIES, f"unknown diagnostic category {category!r}"
        values = (code, message, severity, file, line, column, help, notes, category)
        for name, value in zip(_FIELDS, values, strict=True):
            object.__setattr__(self, name, value)

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in _FIELDS)

    def replace(self, **changes) -> Diagnostic:
        """A copy with some fields changed (what `dataclasses.replace` does)."""
        values = dict(zip(_FIELDS, self._values(), strict=True))
        values.update(changes)
        return Diagnostic(**values)

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return self._values() == other._values()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in zip(_FIELDS, self._values()))
        return f"Diagnostic({fields})"

    def __setattr__(self, name, value):
        raise AttributeError(f"cannot assign to field {name!r}: a Diagnostic is frozen")

    def __delattr__(self, name):
        raise AttributeError(f"cannot delete field {name!r}: a Diagnostic is frozen")

    def __reduce__(self):  # pickle and copy rebuild it through __init__ (it refuses setattr)
        return (Diagnostic, self._values())

    @property
    def location(self) -> str | None:
        if self.file is None:
            return None
        parts = [self.file] + [str(n) for n in (self.line, self.column) if n is not None]
        return ":".join(parts)

    def render(self, root: Path | None = None) -> str:
        """Text form: header, location arrow, the source line with a caret, notes, help."""
        out = [f"{self.severity}[{self.code}]: {self.message}"]
        if self.location:
            out.append(f"  --> {self.location}")
            snippet = _source_line(self.file, self.line, root)
            if snippet is not None:
                snippet, column = _window(snippet, self.column)
                width = len(str(self.line))
                start, length = _underline(snippet, column)
                pad, marker = " " * start, "^" * length
                out += [
                    f"{' ' * width} |",
                    f"{self.line} | {snippet}",
                    f"{' ' * width} | {pad}{marker}",
                ]
        out += [f"  = note: {n}" for n in self.notes]
        if self.help:
            out.append(f"help: {self.help}")
        return "\n".join(out)

    def to_json(self) -> dict:
        data = dict(zip(_FIELDS, self._values(), strict=True))
        data["notes"] = list(self.notes)
        return data


def _default_category(code: str) -> str:
    if code.startswith("RF"):
        return "pins"
    namespace = code.split(".", 1)[0]
    return namespace if namespace in CATEGORIES else "other"


def _source_line(file: str | None, line: int | None, root: Path | None) -> str | None:
    if not file or not line:
        return None
    path = Path(file)
    if not path.is_absolute() and root is not None:
        path = root / path
    lines = _file_lines(path)
    if lines is not None and 1 <= line <= len(lines):
        text = lines[line - 1].rstrip()
    else:
        text = _streamed_line(path, line)
    if text is None:
        return None
    return "".join(c if c.isprintable() or c == "\t" else "\ufffd" for c in text)


_LINES_CACHE: dict[tuple, list[str]] = {}
SNIPPET_WIDTH = 160  # a 1 MB minified line is shown as a window around the column


LARGEST_CACHED_FILE = 4 * 2**20  # a larger file (a data file) is streamed to the one line


def _file_lines(path: Path) -> list[str] | None:
    """The file's lines (LF/CRLF only, like TOML and YAML), read once per version of the file:
    20,000 diagnostics against one .gitmodules must not read it 20,000 times."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > LARGEST_CACHED_FILE:
            return None  # a directory or a pipe has no lines (and reading a pipe blocks)
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key not in _LINES_CACHE:
            if len(_LINES_CACHE) > 64:
                _LINES_CACHE.clear()
            text = path.read_bytes().decode("utf-8", errors="replace")
            _LINES_CACHE[key] = [x.removesuffix("\r") for x in text.split("\n")]
        return _LINES_CACHE[key]
    except OSError:
        return None


def _streamed_line(path: Path, line: int) -> str | None:
    """The start of line `line` of a large file, read in bounded pieces (a data file's 100 MB
    line must not be read whole to show its first characters)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None
        with path.open("rb") as f:
            for _ in range(line - 1):
                while (piece := f.readline(2**20)) and not piece.endswith(b"\n"):
                    pass
                if not piece:
                    return None
            return f.readline(4 * SNIPPET_WIDTH).decode("utf-8", errors="replace").rstrip("\r\n")
    except OSError:
        return None


def _window(snippet: str, column: int | None) -> tuple[str, int | None]:
    """At most SNIPPET_WIDTH characters of a long line, around `column` (which moves with it)."""
    if len(snippet) <= SNIPPET_WIDTH:
        return snippet, column
    start = max(0, min((column or 1) - 1 - SNIPPET_WIDTH // 4, len(snippet) - SNIPPET_WIDTH))
    head = "..." if start else ""
    text = head + snippet[start : start + SNIPPET_WIDTH] + "..."
    return text, None if column is None else column - start + len(head)


def _underline(snippet: str, column: int | None) -> tuple[int, int]:
    """(start, length) of the token to underline: the word at `column`, or the whole line."""
    if column is None:
        start = len(snippet) - len(snippet.lstrip())
        return start, max(len(snippet.strip()), 1)
    start = min(max(column - 1, 0), max(len(snippet) - 1, 0))
    end = start
    while end < len(snippet) and not snippet[end].isspace() and snippet[end] not in ":=,":
        end += 1
    return start, max(end - start, 1)


class RlflowError(Exception):
    """A user-facing failure: carries diagnostics and the exit code to end with.

    Raise it for bad user input (files, keys, values, flags); use `assert` only for rlflow's
    own invariants. The CLI catches it, prints every diagnostic, and exits; no traceback.
    """

    def __init__(self, diagnostics: Diagnostic | list[Diagnostic], exit_code: int = EXIT_USAGE):
        self.diagnostics = (
            [diagnostics] if isinstance(diagnostics, Diagnostic) else list(diagnostics)
        )
        self.exit_code = exit_code
        super().__init__("\n".join(d.render() for d in self.diagnostics))


def file_error(code: str, message: str, file: str, line: int | None, help: str) -> RlflowError:  # noqa: A002
    """One error at `file` (and `line`, when known) that rlflow cannot read or parse: what is
    wrong and how to fix it."""
    return RlflowError(Diagnostic(code, message, file=file, line=line, help=help))


def summary_line(diagnostics: list[Diagnostic]) -> str:
    errors = sum(d.severity == "error" for d in diagnostics)
    warnings = sum(d.severity == "warning" for d in diagnostics)
    return f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}"


def print_diagnostics(
    diagnostics: list[Diagnostic], fmt: str = "text", root: Path | None = None, stream=None
) -> None:
    """Print all diagnostics then a count (text), or one JSON document (json)."""
    stream = stream or sys.stderr
    if fmt == "json":
        import json  # only here: login-node commands start faster without it

        doc = {
            "diagnostics": [d.to_json() for d in diagnostics],
            "summary": summary_line(diagnostics),
        }
        print(json.dumps(doc, indent=2), file=stream)
        return
    for d in diagnostics:
        print(d.render(root), file=stream)
        print(file=stream)
    if diagnostics:
        print(summary_line(diagnostics), file=stream)
