"""Map TOML key paths to line:column, which tomllib does not report.

The document has already been parsed by tomllib, so this only needs enough lexing to know,
for every line, which table it belongs to and whether it starts a `key = value` at the top
level of that table (not inside a multi-line array, inline table or multi-line string).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BARE_KEY = r"[A-Za-z0-9_-]+"
_KEY_PART = rf"(?:{_BARE_KEY}|\"(?:[^\"\\]|\\.)*\"|'[^']*')"
_DOTTED_KEY = re.compile(rf"\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")
_HEADER = re.compile(rf"\s*(\[\[?)\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*\]\]?\s*(?:#.*)?$")

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class _Entry:
    path: Path  # full key path; array-of-tables entries carry their index
    line: int  # 1-based
    column: int  # 1-based column of the key (or of the header's first key)
    end: int  # last line (inclusive) of this entry's value or table
    is_table: bool = False


def _split_key(text: str) -> tuple[str, ...]:
    parts = re.findall(_KEY_PART, text)
    return tuple(p[1:-1] if p[:1] in "\"'" else p for p in parts)


class TomlLines:
    """Line index of one TOML document: `locate(path)` -> (line, column) or (None, None)."""

    def __init__(self, text: str):
        self.lines = split_lines(text)
        self.entries: list[_Entry] = []
        self._index: dict[Path, _Entry] = {}
        self._open: list[int] = []  # entries whose end line is not known yet
        self._scan()

    @staticmethod
    def deepest_line(text: str) -> int:
        """The line on which bracket nesting is deepest (where a too-deep document goes wrong)."""
        lexer, best, best_line = _Lexer(), -1, 1
        for number, line in enumerate(split_lines(text), start=1):
            lexer.feed(line)
            if lexer.max_depth > best:
                best, best_line = lexer.max_depth, number
        return best_line

    def locate(self, path: Path, needle: re.Pattern | None = None) -> tuple[int | None, int | None]:
        """Where `path` is set; with `needle`, the first match of it inside that value.

        Falls back to the nearest enclosing key or table that exists in the text.
        """
        for n in range(len(path), 0, -1):
            entry = self._find(path[:n])
            if entry is None:
                continue
            if needle is not None:
                hit = self._search(entry, needle)
                if hit:
                    return hit
            return entry.line, entry.column
        return None, None

    def _find(self, path: Path) -> _Entry | None:
        if not self._index:
            for entry in reversed(self.entries):  # the first entry of a path wins
                self._index[entry.path] = entry
        return self._index.get(path)

    def _search(self, entry: _Entry, needle: re.Pattern) -> tuple[int, int] | None:
        for number in range(entry.line, entry.end + 1):
            text = self.lines[number - 1]
            start = entry.column - 1 if number == entry.line else 0
            match = needle.search(text, start)
            if match:
                at = match.start("at") if "at" in needle.groupindex else match.start()
                return number, at + 1
        return None

    def _scan(self) -> None:
        table: Path = ()
        array_counts: dict[Path, int] = {}
        lexer = _Lexer()
        for number, text in enumerate(self.lines, start=1):
            at_top = lexer.at_top_level()
            header = _HEADER.match(text) if at_top else None
            if header:
                keys = _split_key(header.group(2))
                if header.group(1) == "[[":
                    index = array_counts.get(keys, 0)
                    array_counts[keys] = index + 1
                    keys = keys + (index,)
                table = keys
                self._close_open(number - 1)
                self._open.append(len(self.entries))
                self.entries.append(_Entry(table, number, header.start(2) + 1, -1, is_table=True))
                continue
            key = _DOTTED_KEY.match(text) if at_top else None
            if key:
                self._close_open(number - 1, keep_tables=True)
                path = table + _split_key(key.group(1))
                self._open.append(len(self.entries))
                self.entries.append(_Entry(path, number, key.start(1) + 1, -1))
            lexer.feed(text)
        self._close_open(len(self.lines))

    def _close_open(self, last_line: int, keep_tables: bool = False) -> None:
        """Set the end line of the entries still open (a key ends where the next key starts)."""
        still_open = []
        for i in self._open:
            entry = self.entries[i]
            if keep_tables and entry.is_table:
                still_open.append(i)
                continue
            end = max(last_line, entry.line)
            self.entries[i] = _Entry(entry.path, entry.line, entry.column, end, entry.is_table)
        self._open = still_open


class _Lexer:
    """Tracks bracket depth and multi-line strings across lines (comments and strings skipped)."""

    def __init__(self):
        self.depth = 0
        self.max_depth = 0
        self.in_multiline: str | None = None  # '"""' or "'''"

    def at_top_level(self) -> bool:
        return self.depth == 0 and self.in_multiline is None

    def feed(self, line: str) -> None:
        i = 0
        while i < len(line):
            if self.in_multiline:
                end = line.find(self.in_multiline, i)
                if end == -1:
                    return
                i, self.in_multiline = end + 3, None
                continue
            ch = line[i]
            if ch == "#":
                return
            if line.startswith('"""', i) or line.startswith("'''", i):
                self.in_multiline, i = line[i : i + 3], i + 3
                continue
            if ch in "\"'":
                i = _skip_string(line, i)
                continue
            if ch in "[{":
                self.depth += 1
                self.max_depth = max(self.max_depth, self.depth)
            elif ch in "]}":
                self.depth = max(self.depth - 1, 0)
            i += 1


def split_lines(text: str) -> list[str]:
    """TOML lines: only LF and CRLF end a line (`str.splitlines` also splits on U+2028...)."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _skip_string(line: str, start: int) -> int:
    quote, i = line[start], start + 1
    while i < len(line):
        if quote == '"' and line[i] == "\\":
            i += 2
            continue
        if line[i] == quote:
            return i + 1
        i += 1
    return i
