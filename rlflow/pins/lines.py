"""Map TOML key paths to line:column, which tomllib does not report.

The document has already been parsed by tomllib, so this only needs enough lexing to know,
for every line, which table it belongs to and whether it starts a `key = value` at the top
level of that table (not inside a multi-line array, inline table or multi-line string).

Lazy and linear: lines are indexed only as far as a lookup needs (a 50 MB `[tool.x]` after
`[project]` is never lexed for `project.dependencies`), each line once, and the lexer jumps
from one bracket, quote or `#` to the next with a regex instead of walking characters. The
items of an array are located in one pass over it (`item`), not searched for one by one.
"""

from __future__ import annotations

import re
from functools import cached_property

_BARE_KEY = r"[A-Za-z0-9_-]+"
_KEY_PART = rf"(?:{_BARE_KEY}|\"(?:[^\"\\]|\\.)*\"|'[^']*')"
_DOTTED_KEY = re.compile(rf"\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")
_HEADER = re.compile(rf"\s*(\[\[?)\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*\]\]?\s*(?:#.*)?$")
_SPECIAL = re.compile(r"[#\"'\[\]{}]")  # all the lexer reacts to
_ITEM_SPECIAL = re.compile(r"[#\"'\[\]{},]")
_NOT_BLANK = re.compile(r"[^ \t]")
_STRING = {'"': re.compile(r'"(?:[^"\\]|\\.)*"?'), "'": re.compile(r"'[^']*'?")}

Path = tuple[str | int, ...]


class _Entry:
    """A key or table header: its full path (array-of-tables entries carry their index), the
    1-based line and column of the key, the last line of its value or table (-1 while the
    scan has not reached the next key), and where its value starts (keys only)."""

    __slots__ = ("path", "line", "column", "end", "is_table", "value_column")

    def __init__(self, path: Path, line: int, column: int, is_table: bool, value_column: int):
        self.path, self.line, self.column, self.is_table = path, line, column, is_table
        self.end, self.value_column = -1, value_column


def _split_key(text: str) -> tuple[str, ...]:
    parts = re.findall(_KEY_PART, text)
    return tuple(p[1:-1] if p[:1] in "\"'" else p for p in parts)


class TomlLines:
    """Line index of one TOML document: `locate(path)` -> (line, column) or (None, None)."""

    def __init__(self, text: str):
        self._text = text  # split into lines on the first lookup (most documents get none)
        self._index: dict[Path, _Entry] = {}  # the first entry of a path wins
        self._open: list[_Entry] = []  # entries whose end line is not known yet
        self._items: dict[Path, list[tuple[int, int]]] = {}  # a key's array -> its items
        self._scanner = self._scan()
        self._scanned = False

    @cached_property
    def lines(self) -> list[str]:
        return split_lines(self._text)

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

    def item(self, path: Path, count: int) -> tuple[int, int] | None:
        """Where item `path[-1]` of the `count`-item array at `path[:-1]` starts (a string's
        text: after its quote); None when that array is not a key of its own (an inline
        table's value) or its items cannot be told apart."""
        entry = self._find(path[:-1])
        items = self._items.get(entry.path) if entry is not None else None
        return items[path[-1]] if items is not None and len(items) == count else None

    def _find(self, path: Path) -> _Entry | None:
        """The entry of `path`, its end known; scans only as far as it must: to the entry's
        end, or to a key (not a table) that holds `path` inside its value."""
        while True:
            entry = self._index.get(path)
            if entry is not None and entry.end >= 0:
                return entry
            if entry is None and self._inside_a_key(path):
                return None
            if self._scanned:
                return entry
            if not next(self._scanner, False):
                self._scanned = True

    def _inside_a_key(self, path: Path) -> bool:
        """True when a prefix of `path` is a key already read: its whole value is on its
        lines, so no entry of `path` can follow (TOML defines a value once)."""
        for n in range(len(path) - 1, 0, -1):
            entry = self._index.get(path[:n])
            if entry is not None:
                return not entry.is_table
        return False

    def _search(self, entry: _Entry, needle: re.Pattern) -> tuple[int, int] | None:
        for number in range(entry.line, entry.end + 1):
            text = self.lines[number - 1]
            start = entry.column - 1 if number == entry.line else 0
            match = needle.search(text, start)
            if match:
                at = match.start("at") if "at" in needle.groupindex else match.start()
                return number, at + 1
        return None

    def _scan(self):
        """Index the document line by line; yields True after every line that adds an entry.
        A key's array value is lexed once, by `_array_items`, which also notes its items."""
        table: Path = ()
        array_counts: dict[Path, int] = {}
        lexer = _Lexer()
        number = 0
        while number < len(self.lines):
            text = self.lines[number]
            number += 1
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
                self._add(_Entry(table, number, header.start(2) + 1, True, 0))
                yield True
                continue
            key = _DOTTED_KEY.match(text) if at_top else None
            if key:
                self._close_open(number - 1, keep_tables=True)
                path = table + _split_key(key.group(1))
                self._add(_Entry(path, number, key.start(1) + 1, False, key.end()))
                value = _NOT_BLANK.search(text, key.end())
                if value is not None and value.group() == "[":
                    items, number = _array_items(self.lines, number, value.start())
                    self._items.setdefault(path, items)  # the first entry of a path wins
                else:
                    lexer.feed(text, key.end())
                yield True
                continue
            lexer.feed(text)
        self._close_open(len(self.lines))

    def _add(self, entry: _Entry) -> None:
        self._open.append(entry)
        self._index.setdefault(entry.path, entry)

    def _close_open(self, last_line: int, keep_tables: bool = False) -> None:
        """Set the end line of the entries still open (a key ends where the next key starts)."""
        still_open = []
        for entry in self._open:
            if keep_tables and entry.is_table:
                still_open.append(entry)
                continue
            entry.end = max(last_line, entry.line)
        self._open = still_open


class _Lexer:
    """Tracks bracket depth and multi-line strings across lines (comments and strings skipped)."""

    def __init__(self):
        self.depth = 0
        self.max_depth = 0
        self.in_multiline: str | None = None  # '"""' or "'''"

    def at_top_level(self) -> bool:
        return self.depth == 0 and self.in_multiline is None

    def feed(self, line: str, start: int = 0) -> None:
        i = start
        if self.in_multiline:
            i = _multiline_end(line, i, self.in_multiline)
            if i < 0:
                return
            self.in_multiline = None
        while True:
            match = _SPECIAL.search(line, i)
            if match is None:
                return
            j, ch = match.start(), match.group()
            if ch == "#":
                return
            if ch in "\"'":
                i, self.in_multiline = _skip_string(line, j)
                if self.in_multiline:
                    return
                continue
            if ch in "[{":
                self.depth += 1
                self.max_depth = max(self.max_depth, self.depth)
            else:
                self.depth = max(self.depth - 1, 0)
            i = j + 1


def _array_items(lines: list[str], line: int, column: int) -> tuple[list[tuple[int, int]], int]:
    """The items of the array that opens at lines[line-1][column] (1-based (line, column)
    each; a string item's column is its text's, after the quote and blanks), and the line on
    which the array closes (after it there is at most a comment: TOML ends a key there)."""
    items: list[tuple[int, int]] = []
    depth, expect, multiline = 0, False, None
    for number in range(line, len(lines) + 1):
        text = lines[number - 1]
        i = column if number == line else 0
        if multiline:
            i = _multiline_end(text, i, multiline)
            if i < 0:
                continue
            multiline = None
        while True:
            if expect:  # after `[` or `,` of the array itself: the next thing is an item
                match = _NOT_BLANK.search(text, i)
                if match is None or match.group() == "#":
                    break
                expect = False
                if match.group() != "]":
                    items.append((number, _text_column(text, match.start())))
            match = _ITEM_SPECIAL.search(text, i)
            if match is None or match.group() == "#":
                break
            j, ch = match.start(), match.group()
            if ch in "\"'":
                i, multiline = _skip_string(text, j)
                if multiline:
                    break
                continue
            i = j + 1
            if ch in "[{":
                depth += 1
                expect = depth == 1
            elif ch in "]}":
                depth -= 1
                if depth == 0:
                    return items, number
            elif depth == 1:  # a comma between the array's items
                expect = True
    return items, len(lines)


def _text_column(text: str, start: int) -> int:
    """1-based column of an item's text: after a string's quote(s) and leading blanks."""
    if text[start] not in "\"'":
        return start + 1
    quote = text[start]
    i = start + (3 if text.startswith(quote * 3, start) else 1)
    blank = _NOT_BLANK.search(text, i)
    return blank.start() + 1 if blank else start + 1


def _skip_string(line: str, start: int) -> tuple[int, str | None]:
    """The index after the string opening at `start`, or (-1, delimiter) when it is a
    multi-line string that continues on the next line."""
    quote = line[start]
    if line.startswith(quote * 3, start):
        end = _multiline_end(line, start + 3, quote * 3)
        return (end, None) if end >= 0 else (-1, quote * 3)
    return _STRING[quote].match(line, start).end(), None


def _multiline_end(line: str, start: int, delimiter: str) -> int:
    """The index after the `delimiter` that closes a multi-line string, or -1. Up to two
    quotes just before it are content (four quotes are a quote, then the end); a backslash
    escapes a quote in a basic string."""
    i = start
    while True:
        end = line.find(delimiter, i)
        if end < 0:
            return -1
        if delimiter == '"""':
            slash = end
            while slash > start and line[slash - 1] == "\\":
                slash -= 1
            if (end - slash) % 2:
                i = end + 1
                continue
        stop = end + 3
        while stop < len(line) and line[stop] == delimiter[0] and stop - end < 5:
            stop += 1
        return stop


def split_lines(text: str) -> list[str]:
    """TOML lines: only LF and CRLF end a line (`str.splitlines` also splits on U+2028...)."""
    return [line.removesuffix("\r") for line in text.split("\n")]
