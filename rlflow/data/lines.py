"""A data file's lines, read safely: each at most a bounded length (a longer one is skipped
without being held in memory) and checked to be UTF-8, with its line number.

A 100 MB line once took 400 s and 14 GB before anything refused it; here it costs one pass of
the disk. Standard library only: the dry run reads data files on the login node.
"""

from __future__ import annotations

from pathlib import Path

MAX_ROW_BYTES = 4 * 2**20  # one JSONL row; media go in files the row names


def bounded_lines(file: Path, limit: int = MAX_ROW_BYTES):
    """(line number, text, problem) for each line of `file`: text is the line decoded as UTF-8,
    or None with the problem (not UTF-8, or longer than `limit` bytes: never read whole)."""
    try:
        raw = file.open("rb")
    except OSError as exc:
        yield 0, None, f"cannot read {file}: {exc.strerror or exc}"
        return
    with raw:
        number = 0
        while line := raw.readline(limit + 1):
            number += 1
            if len(line) > limit and not line.endswith(b"\n"):
                size = len(line)
                while more := raw.readline(2**20):
                    size += len(more)
                    if more.endswith(b"\n"):
                        break
                yield (
                    number,
                    None,
                    (
                        f"line {number} is {size / 2**20:.1f} MiB, more than the "
                        f"{limit / 2**20:g} MiB a row may hold (images and videos go in files "
                        "the row names)"
                    ),
                )
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield (
                    number,
                    None,
                    (
                        f"line {number} is not valid UTF-8 (byte {line[exc.start]:#04x} at column "
                        f"{exc.start + 1})"
                    ),
                )
                continue
            yield number, text.removeprefix("\ufeff") if number == 1 else text, None
