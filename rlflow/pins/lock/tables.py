"""A local package's `[package.metadata]` tables of a uv.lock, read in the layout uv writes.

These tables (requires-dist, provides-extras, requires-dev) are what `uv lock --check` compares
for every local project, so uvlock.py parses them on every check; tomllib (pure Python) took a
quarter of the lock level on the real NeMo-RL lock and its ~700 requirement lines. uv writes
them in one layout:

    [package.metadata]
    requires-dist = [
        { name = "torch", marker = "sys_platform == 'linux'", specifier = ">=2.6" },
    ]
    provides-extras = ["a", "b"]

    [package.metadata.requires-dev]
    test = [{ name = "pytest" }]

`read(text)` returns exactly what `tomllib.loads(text)` returns for a text in that layout
(those two headers in that order, `key = value` lines, arrays one item a line or on one line,
inline tables and strings spaced as uv spaces them, strings without escapes or control
characters), and None for anything else: then tomllib reads it, and words its errors.
"""

from __future__ import annotations

import re

_KEY = re.compile(r"[A-Za-z0-9_-]+")
_STRING = re.compile(r'"([^"\\\x00-\x1f\x7f]*)"')
_HEADERS = {"[package.metadata]": 0, "[package.metadata.requires-dev]": 1}


class _Unusual(Exception):
    """Not in uv's layout: tomllib must read it."""


def read(text: str) -> dict | None:
    """`tomllib.loads(text)` for tables in uv's layout, else None."""
    try:
        return _read(text.split("\n"))
    except _Unusual:
        return None


def _read(lines: list[str]) -> dict:
    metadata: dict = {}
    table, seen = None, -1
    items: list | None = None  # the open multi-line array
    for line in lines:
        if items is not None:
            if line == "]":
                items = None
            elif line.startswith("    "):
                value, end = _value(line, 4)
                if line[end:] != ",":
                    raise _Unusual
                items.append(value)
            else:
                raise _Unusual
            continue
        if not line:
            continue
        if line in _HEADERS:
            order = _HEADERS[line]
            if order <= seen or (order == 1 and "requires-dev" in metadata):
                raise _Unusual  # a repeated or reordered table: tomllib's rules decide
            seen, table = order, metadata if order == 0 else metadata.setdefault("requires-dev", {})
            continue
        key = _KEY.match(line)
        if table is None or key is None or not line.startswith(" = ", key.end()):
            raise _Unusual
        name = key.group()
        if name in table:
            raise _Unusual  # a key set twice: tomllib's error
        if line.endswith(" = [") and len(line) == key.end() + 4:
            items = table[name] = []
            continue
        table[name], end = _value(line, key.end() + 3)
        if end != len(line):
            raise _Unusual
    if items is not None:
        raise _Unusual  # an array never closed
    return {"package": {"metadata": metadata}} if seen >= 0 else {}


def _value(line: str, at: int):
    """The string, array or inline table starting at `line[at]`, and the index after it."""
    first = line[at : at + 1]
    if first == '"':
        match = _STRING.match(line, at)
        if match is None:
            raise _Unusual
        return match.group(1), match.end()
    if first == "[":
        out: list = []
        at += 1
        while line[at : at + 1] != "]":
            if out:
                if not line.startswith(", ", at):
                    raise _Unusual
                at += 2
            value, at = _value(line, at)
            out.append(value)
        return out, at + 1
    if first == "{":
        return _table(line, at)
    raise _Unusual


def _table(line: str, at: int) -> tuple[dict, int]:
    """`{ key = value, key = value }` as uv writes it."""
    if not line.startswith("{ ", at):
        raise _Unusual
    out: dict = {}
    at += 2
    while True:
        key = _KEY.match(line, at)
        if key is None or not line.startswith(" = ", key.end()) or key.group() in out:
            raise _Unusual
        out[key.group()], at = _value(line, key.end() + 3)
        if line.startswith(" }", at):
            return out, at + 2
        if not line.startswith(", ", at):
            raise _Unusual
        at += 2
