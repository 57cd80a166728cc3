"""Bounded reads of files other processes (or people) put in place: run directories, CI files,
metrics. A file there may be a named pipe (reading it waits for a writer, forever), a link to
/dev/zero (reading it fills the memory), or a 50 GB log where a 1 kB record belongs. Every reader
of such a file goes through `read_bytes`, which reads only a regular file, at most `limit` bytes,
within `seconds`, and otherwise raises `UnreadableFile` saying what the file is instead.

`UnreadableFile` is an OSError (its `strerror` is the reason, `str()` too): a caller that already
turns "cannot read" into a diagnostic (`err.strerror or err`) needs no new branch. A file that
does not exist raises FileNotFoundError as before.

The time limit is checked between reads of CHUNK bytes: it stops a read that a slow file system
drags out, not one system call that a hung mount never answers (nothing in-process can).
Standard library only, imports nothing of rlflow: the node launcher and every login-node command
use it.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

CHUNK = 1 << 20
DEFAULT_SECONDS = 10.0


class UnreadableFile(OSError):
    """A file that is not read: not a regular file, over its size limit, or too slow."""

    def __init__(self, code: int, reason: str, path: str | Path):
        super().__init__(code, reason, str(path))

    def __str__(self) -> str:
        return self.strerror


def size_text(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def not_regular(path: str | Path, mode: int) -> UnreadableFile:
    """The error for a path whose (followed) mode is not a regular file."""
    what = "it is"
    if os.path.islink(path):
        try:
            what = f"it links to {os.readlink(path)}, which is"
        except OSError:
            pass
    code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
    return UnreadableFile(code, f"{what} {_kind(mode)}, not a regular file", path)


def open_regular(path: str | Path):
    """A binary file object for a regular file only (a FIFO is never waited on, a device never
    opened); its size is `os.fstat(f.fileno()).st_size`."""
    mode = os.stat(path).st_mode  # follows links: a link to /dev/zero is a device
    if not stat.S_ISREG(mode):
        raise not_regular(path, mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode  # replaced between the stat and the open
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_stream(handle, path: str | Path, limit: int, seconds: float = DEFAULT_SECONDS) -> bytes:
    """At most `limit` bytes from an open file, from where it stands, within `seconds`."""
    deadline = time.monotonic() + seconds
    pieces, total = [], 0
    while total <= limit:
        piece = handle.read(min(CHUNK, limit + 1 - total))
        if not piece:
            break
        pieces.append(piece)
        total += len(piece)
        if time.monotonic() > deadline:
            raise UnreadableFile(
                errno.ETIMEDOUT,
                f"reading it took over {seconds:g} s (a slow or hung file system?)",
                path,
            )
    data = b"".join(pieces)
    if len(data) > limit:
        raise UnreadableFile(
            errno.EFBIG, f"it is over {size_text(limit)}, the most rlflow reads of it", path
        )
    return data


def read_bytes(path: str | Path, limit: int, seconds: float = DEFAULT_SECONDS) -> bytes:
    """A regular file's bytes, at most `limit` of them, read within `seconds`."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise UnreadableFile(
                errno.EFBIG,
                f"it is {size_text(size)}, over {size_text(limit)}, the most rlflow reads of it",
                path,
            )
        return read_stream(handle, path, limit, seconds)


def read_text(
    path: str | Path, limit: int, seconds: float = DEFAULT_SECONDS, errors: str = "strict"
) -> str:
    """`read_bytes` decoded as UTF-8 (`errors` as for bytes.decode)."""
    return read_bytes(path, limit, seconds).decode("utf-8", errors)
