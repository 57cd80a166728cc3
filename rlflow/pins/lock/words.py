"""What a stale lock is, in words: the `Stale` verdict of the lock level's checks (what changed,
and the pyproject line that changed it), and the wording they share: requirement entries shown
as written, a changed setting's line found in pyproject.toml, values shown as `unset` or quoted.
Used by level.py (the lock level), settings.py and projects.py (uv's staleness test).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from rlflow.pins.model import Location
from rlflow.pins.records import record


@record
class Stale:
    what: str
    where: Location | None = None


def shown(value) -> str:
    return "unset" if value is None else f"`{value}`"


def difference(what: str, added: list, removed: list) -> str:
    def show(key) -> str:
        name, extras, source = key
        extra = f"[{','.join(extras)}]" if extras else ""
        return f"`{name}{extra}{_source_text(source)}`"

    parts = []
    if added:
        parts.append("not locked as written: " + ", ".join(show(k) for k in added[:3]))
    if removed:
        parts.append("locked but no longer asked for: " + ", ".join(show(k) for k in removed[:3]))
    return f"{what} changed since the lock was written ({'; '.join(parts)})"


def _source_text(source: tuple) -> str:
    kind = source[0]
    if kind == "registry":
        spec = (
            ",".join(op + v for op, v in source[1]) if source[1] and len(source[1][0]) == 2 else ""
        )
        return spec + (f" from index {source[2]}" if source[2] else "")
    if kind == "git":
        return f" @ git {source[1]}" + (f"@{source[3]}" if source[3] else "")
    if kind == "url":
        return f" @ {source[1]}"
    return f" from {source[1]} path {source[2]}"


def rel(lock, directory: str) -> str:
    return os.path.relpath(directory, lock.directory)


def line(project, key: str, diff=None) -> Location | None:
    """The pyproject line that sets `key` (or names the first changed package)."""
    path = Path(project.directory) / "pyproject.toml"
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError:
        return None
    names = [k[0] for k in (diff[0] or diff[1])] if diff else []
    patterns = [
        re.compile(r"[\"']\s*" + "[-_.]?".join(re.escape(p) for p in re.split(r"[-_.]", n)), re.I)
        for n in names[:1]
    ]
    setting = re.compile(rf"^\s*\[?\[?[\w.\"-]*{re.escape(key)}\b")
    rel = str(path)
    at = next((n for n, line in enumerate(lines, start=1) if setting.search(line)), None)
    for pattern in patterns:  # the changed package: under its setting first, then anywhere
        for start in (at, 1) if at else (1,):
            for number, line in enumerate(lines[start - 1 :], start=start):
                if pattern.search(line):
                    return Location(rel, number)
    return Location(rel, at)


def texts(value) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def first_stale(checks) -> Stale | None:
    """The first verdict of `checks` (callables, run in order) that finds the lock stale. A check
    that cannot decide offline (`Undecidable`) does not stop the others, which may still find it
    stale for certain; if none does, the first undecided one is raised."""
    from rlflow.pins.workspace import Undecidable

    undecided = None
    for check in checks:
        try:
            found = check()
        except Undecidable as why:
            undecided = undecided or why
            continue
        if found:
            return found
    if undecided:
        raise undecided
    return None
