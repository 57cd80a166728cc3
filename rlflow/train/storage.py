"""The run directory's disk: writable at start, enough free space before each checkpoint.

A full disk must say so ("no space left on /dev/sda1 (needed 12.4 GB, had 3.1 GB)"), not
"unexpected pos 6633216" from deep inside torch.save, and a read-only run directory must say
that before any model is loaded.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError

GB = 1e9


def prepare_run_dir(directory: Path) -> None:
    """Create the run directory and prove it takes a file; a diagnostic if it cannot."""
    probe = directory / f".rlflow-write-test-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok\n")
        probe.unlink()
    except OSError as err:
        read_only = err.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        raise RlflowError(
            Diagnostic(
                "rundir.not-writable",
                f"the run directory {directory} is not writable: {err.strerror or err}"
                + (f" ({err.filename})" if err.filename else ""),
                help=(
                    "pass --run-dir on a writable file system (checkpoints and metrics go "
                    "there), or fix its permissions"
                    if read_only
                    else "pass --run-dir with a directory rlflow can create"
                ),
            )
        ) from None


def replace_file(path: Path, text: str) -> None:
    """Write a new file and rename it over `path`: a process killed meanwhile leaves the old
    file whole, never an empty or half-written one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def free_bytes(path: Path) -> int:
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    return shutil.disk_usage(existing).free


def device_of(path: Path) -> str:
    """The file system `path` lives on, as `df` names it: its device, else its mount point."""
    try:
        target = os.path.realpath(path)
        best = ("", "/")
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 2:
                    continue
                source, mount = fields[0], fields[1].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[1]):
                    best = (source, mount)
        source, mount = best
        return source if source.startswith("/dev/") else f"{mount} ({source or 'unknown'})"
    except OSError:
        return str(path)


def no_space(path: Path, needed: int, had: int, detail: str) -> RlflowError:
    return RlflowError(
        Diagnostic(
            "disk.no-space",
            f"no space left on {device_of(path)} (needed {_gb(needed)} GB, had {_gb(had)} GB)",
            notes=(detail,),
            help="free space there, lower checkpointing.keep_last, or pass --run-dir on a larger "
            "disk; the previous checkpoint is intact and the run resumes from it",
        )
    )


def is_no_space(err: BaseException, path: Path, needed: int) -> bool:
    """An OSError ENOSPC, or torch's zip writer failing ("unexpected pos", "file write
    failed") on a disk that is now nearly full."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return free_bytes(path) < max(needed, 1 << 20)
    except OSError:
        return False


def _gb(n: int) -> str:
    value = n / GB
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if value >= 0.01 else f"{value:.6f}"
