"""What a signal will really run: the kernel's record, not Python's.

`signal.getsignal` shows only Python's own record. A C library can replace the handler
underneath it with sigaction(2), and Python never notices: on GPUs, Triton's first kernel
compile runs MLIR's pass manager with its crash reproducer on, which installs LLVM's signal
handlers (llvm::sys RegisterHandlers). LLVM's SIGUSR1 handler ("print status") swallows the
signal; its SIGHUP/SIGINT/SIGTERM/SIGUSR2 handler puts the previous handlers back and raises
the signal again, so those still reach Python once.

This module reads the handler a signal will run (sigaction with no new action: read-only) and
names the library it lives in (dladdr), and reads which threads block a signal
(/proc/self/task/*/status). Linux and glibc; elsewhere every answer is None. Standard library
only: the watchdog imports it before torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path


class _Sigaction(ctypes.Structure):  # glibc's struct sigaction on Linux (x86-64 and aarch64)
    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * 16),  # sigset_t: 1024 bits
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("fname", ctypes.c_char_p),
        ("fbase", ctypes.c_void_p),
        ("sname", ctypes.c_char_p),
        ("saddr", ctypes.c_void_p),
    ]


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.sigaction.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_Sigaction)]
    _libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
except (OSError, AttributeError):  # not glibc
    _libc = None


def handler_address(signum: int) -> int | None:
    """The address of the handler `signum` runs now (0 SIG_DFL, 1 SIG_IGN); None if unknown."""
    if _libc is None:
        return None
    action = _Sigaction()
    if _libc.sigaction(int(signum), None, ctypes.byref(action)) != 0:
        return None
    return action.handler or 0


def owner(signum: int) -> str | None:
    """Who handles `signum`: "SIG_DFL", "SIG_IGN", or the file (and symbol, when exported) of
    the handler, e.g. "libpython3.12.so.1.0" or "libtriton.so"."""
    address = handler_address(signum)
    if address is None:
        return None
    if address in (0, 1):
        return ("SIG_DFL", "SIG_IGN")[address]
    info = _DlInfo()
    if not _libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.fname:
        return hex(address)
    name = os.path.basename(info.fname.decode(errors="replace")) or "the executable"
    return f"{name}:{info.sname.decode(errors='replace')}" if info.sname else name


def thread_masks(signum: int) -> dict[str, int] | None:
    """How many of this process's threads block `signum`, and how many there are."""
    bit = 1 << (int(signum) - 1)
    blocked = total = 0
    try:
        for status in Path("/proc/self/task").glob("*/status"):
            for line in status.read_text().splitlines():
                if line.startswith("SigBlk:"):
                    total += 1
                    blocked += bool(int(line.split()[1], 16) & bit)
    except (OSError, ValueError):
        return None
    return {"threads": total, "blocking": blocked}


def snapshot(signums) -> dict[str, dict]:
    """For each signal: its handler's owner and the threads that block it (a trace record)."""
    return {signal.Signals(s).name: {"owner": owner(s), **(thread_masks(s) or {})} for s in signums}
