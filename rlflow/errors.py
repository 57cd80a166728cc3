"""Diagnostics: what went wrong, where, and how to fix it, rendered like a compiler would.

Every user-facing failure in rlflow (a bad recipe key, a pin drift, an sbatch refusal) becomes
one or more `Diagnostic`s. Commands collect them, print all of them, then a count, and exit
with a code that tells scripts what happened: 0 fine, 1 findings, 2 unusable input.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2


@dataclass(frozen=True)
class Diagnostic:
    """One finding. `code` is stable (scripts and docs refer to it); the rest is for humans."""

    code: str
    message: str
    severity: str = "error"  # "error" | "warning"
    file: str | None = None
    line: int | None = None
    column: int | None = None
    help: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

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
                width = len(str(self.line))
                start, length = _underline(snippet, self.column)
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
        data = asdict(self)
        data["notes"] = list(self.notes)
        return data


def _source_line(file: str | None, line: int | None, root: Path | None) -> str | None:
    if not file or not line:
        return None
    path = Path(file)
    if not path.is_absolute() and root is not None:
        path = root / path
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    if 1 <= line <= len(lines):
        return lines[line - 1].rstrip()
    return None


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
