"""A rank's progress reports to its node launcher, and stack dumps on request.

The launcher (rlflow/job/node.py) gives every rank a file to write, RLFLOW_HEARTBEAT_FILE.
On every phase change (and on `beat()` inside long phases) the rank replaces it atomically with

    {"pid": ..., "phase": "logprobs", "step": 812, "time": <CLOCK_MONOTONIC>, "timeout_s": 600}

CLOCK_MONOTONIC is shared by every process of a node, so the launcher compares `time` with its
own clock: a rank silent for longer than its phase's timeout is hung. Each report carries the
timeout of its phase, so the launcher needs no recipe, and start-up, model load and checkpoint
save get their own (generous) limits.

The launcher asks for stacks with DUMP_SIGNAL. faulthandler answers from a C signal handler,
so a rank blocked inside a collective (the GIL held, Python code not running) still writes every
thread's Python stack into its log.

Libraries can take signal handlers over at the C level (Triton's first compile installs LLVM's:
rlflow/train/sigstate.py). On every phase change the rank checks that the dump handler and the
handlers registered with `keep` are still its own, and puts them back if not.
RLFLOW_SIGNAL_TRACE=FILE appends, on every phase change, which library handles each signal
(a JSON line; `benchmarks/signal_gpu.py` reads it).

Outside a launcher (no RLFLOW_HEARTBEAT_FILE) every call here is a no-op, apart from the dump
handler and those checks. Standard library only: imported before torch.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from collections.abc import Callable

from rlflow.train import sigstate

HEARTBEAT_ENV = "RLFLOW_HEARTBEAT_FILE"
DUMP_SIGNAL = signal.SIGUSR2
TRACE_ENV = "RLFLOW_SIGNAL_TRACE"
TRACED_SIGNALS = (signal.SIGUSR1, signal.SIGHUP, signal.SIGTERM, signal.SIGINT, DUMP_SIGNAL)

# Phases with their own recipe key (watchdog.*); every other phase uses phase_timeout_s.
LONG_PHASES = {
    "startup": "startup_timeout_s",
    "preflight": "preflight_timeout_s",
    "model_load": "model_load_timeout_s",
    "checkpoint_save": "checkpoint_timeout_s",
}
DEFAULT_STARTUP_TIMEOUT_S = 900.0  # until the recipe is read


class _State:
    path: str | None = None
    timeouts: dict[str, float] = {}
    default_timeout: float | None = None
    enabled: bool = True
    phase: str = "startup"
    step: int = 0
    stop_requested: bool = False
    note: str | None = None
    keepers: list[Callable[[], None]] = []  # run on every phase change (see `keep`)
    dump_handler: int | None = None  # faulthandler's C handler for DUMP_SIGNAL


_state = _State()


def start() -> None:
    """At the top of a rank: dumps on DUMP_SIGNAL, and the first report (phase `startup`)."""
    _register_dump()
    _state.keepers = [_keep_dump_handler]
    _state.path = os.environ.get(HEARTBEAT_ENV) or None
    _state.timeouts = {"startup": DEFAULT_STARTUP_TIMEOUT_S}
    _trace("startup")
    beat("startup")


def configure(cfg) -> None:
    """The recipe's `watchdog` section (rlflow.recipe.schema.WatchdogConfig)."""
    _state.enabled = cfg.enabled
    _state.timeouts = {phase: float(getattr(cfg, key)) for phase, key in LONG_PHASES.items()}
    _state.default_timeout = float(cfg.phase_timeout_s)
    _write()


def beat(phase: str | None = None, step: int | None = None) -> None:
    """Progress: a new phase (or step), or simply "still working" with neither argument."""
    if step is not None:
        _state.step = step
    if phase is not None and phase != _state.phase:
        _trace(phase)
        for keeper in _state.keepers:
            keeper()
        _state.phase = phase
    _write()


def stop_requested() -> None:
    """The rank heard the stop signal: the launcher stops repeating it to this rank."""
    _state.stop_requested = True
    _write()


def phase() -> str:
    """The phase the rank last reported."""
    return _state.phase


def keep(keeper: Callable[[], None]) -> None:
    """Run `keeper` on every phase change (it puts back a handler a library replaced)."""
    _state.keepers.append(keeper)


def _register_dump() -> None:
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    _state.dump_handler = sigstate.handler_address(DUMP_SIGNAL)


def _keep_dump_handler() -> None:
    now = sigstate.handler_address(DUMP_SIGNAL)
    if now is not None and _state.dump_handler is not None and now != _state.dump_handler:
        faulthandler.unregister(DUMP_SIGNAL)  # register() alone keeps the old installation
        _register_dump()


def _trace(phase: str) -> None:
    """RLFLOW_SIGNAL_TRACE: who handles each signal as `phase` begins (before the checks)."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    record = {
        "rank": os.environ.get("RANK", "0"),
        "phase": phase,
        "after": _state.phase,
        "step": _state.step,
        "time": time.time(),
        "signals": sigstate.snapshot(TRACED_SIGNALS),
    }
    try:
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")
    except OSError:
        pass


def note(text: str) -> None:
    """A one-line reason the launcher puts into the job's failure record (e.g. a preflight
    check that failed on this node)."""
    _state.note = text
    _write()


def _write() -> None:
    if _state.path is None:
        return
    timeout = _state.timeouts.get(_state.phase, _state.default_timeout)
    record = {
        "pid": os.getpid(),
        "phase": _state.phase,
        "step": _state.step,
        "time": time.monotonic(),
        "wall": time.time(),  # compared across nodes (monotonic clocks are per machine)
        "timeout_s": timeout if _state.enabled else None,
        "stop_requested": _state.stop_requested,
        "note": _state.note,
    }
    tmp = f"{_state.path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as out:
            json.dump(record, out)
        os.replace(tmp, _state.path)
    except OSError:
        pass  # a full disk must not kill training; the launcher then sees an old report
