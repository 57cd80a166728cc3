"""locktables.read against tomllib (differential): the `[package.metadata]` tables of every
local project in the real NeMo-RL tree's three uv.lock files and this repository's are read
without tomllib, to the same data; on thousands of edits of them (quotes, escapes, blanks,
brackets, repeated, moved and dropped lines, repeated keys), whatever it reads, tomllib reads
the same."""

from __future__ import annotations

import random
import tarfile
import tomllib
from pathlib import Path

from real_tree import DATA

from rlflow.pins.lock import uvlock
from rlflow.pins.lock.tables import read

EDITS = [
    '"',
    "\\",
    " ",
    ",",
    "{",
    "}",
    "[",
    "]",
    "=",
    "\n",
    "\t",
    "#",
    "'",
    "\x7f",
    "a",
    ".",
    "]\n",
]


def metadata_tables() -> list[str]:
    with tarfile.open(DATA) as archive:
        texts = [
            archive.extractfile(m).read().decode()
            for m in archive.getmembers()
            if m.name.endswith("uv.lock")
        ]
    texts.append((Path(__file__).parents[2] / "uv.lock").read_text(encoding="utf-8"))
    assert len(texts) == 4
    return [
        uvlock._without_artifacts(uvlock._metadata_tables(chunk))
        for text in texts
        for chunk in text.split(uvlock._BLOCK)[1:]
        if "\n[package.metadata" in chunk
    ]


def tomllib_says(text: str):
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return "invalid"


def test_uv_written_tables_read_as_tomllib_reads_them():
    tables = metadata_tables()
    assert len(tables) > 10
    for text in tables:
        assert read(text) is not None, text[:300]
        assert read(text) == tomllib.loads(text), text[:300]


def test_edited_tables_read_as_tomllib_reads_them_or_not_at_all():
    tables = metadata_tables()
    rng = random.Random(24)
    fast = 0
    for _ in range(3000):
        lines = rng.choice(tables).split("\n")
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(lines))
            kind = rng.randrange(5)
            if kind == 0:  # a character in or out
                at = rng.randint(0, len(lines[i]))
                cut = rng.randint(0, 1)
                lines[i] = lines[i][:at] + rng.choice(EDITS) * (1 - cut) + lines[i][at + cut :]
            elif kind == 1:  # a line repeated
                lines.insert(i, lines[i])
            elif kind == 2:  # a line moved
                lines.insert(rng.randrange(len(lines)), lines.pop(i))
            elif kind == 3:  # a line dropped
                lines.pop(i)
            else:  # a key given twice in an inline table
                lines[i] = lines[i].replace("{ name = ", '{ name = "x", name = ', 1)
        text = "\n".join(lines)
        got = read(text)
        if got is not None:
            fast += 1
            assert got == tomllib_says(text), repr(text[:400])
    assert fast > 300, fast  # edits that keep uv's layout were read, not only refused
