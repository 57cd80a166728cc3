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

Outside a launcher (no RLFLOW_HEARTBEAT_FILE) every call here is a no-op, apart from the dump
handler. Standard library only: imported before torch.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

HEARTBEAT_ENV = "RLFLOW_HEARTBEAT_FILE"
DUMP_SIGNAL = signal.SIGUSR2

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


_state = _State()


def start() -> None:
    """At the top of a rank: dumps on DUMP_SIGNAL, and the first report (phase `startup`)."""
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    _state.path = os.environ.get(HEARTBEAT_ENV) or None
    _state.timeouts = {"startup": DEFAULT_STARTUP_TIMEOUT_S}
    beat("startup")


def configure(cfg) -> None:
    """The recipe's `watchdog` section (rlflow.recipe.schema.WatchdogConfig)."""
    _state.enabled = cfg.enabled
    _state.timeouts = {phase: float(getattr(cfg, key)) for phase, key in LONG_PHASES.items()}
    _state.default_timeout = float(cfg.phase_timeout_s)
    _write()


def beat(phase: str | None = None, step: int | None = None) -> None:
    """Progress: a new phase (or step), or simply "still working" with neither argument."""
    if phase is not None:
        _state.phase = phase
    if step is not None:
        _state.step = step
    _write()


def stop_requested() -> None:
    """The rank heard the stop signal: the launcher stops repeating it to this rank."""
    _state.stop_requested = True
    _write()


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
