"""Running rewards from user code: in this process, or in a pool of worker processes.

Workers are spawned (a fresh interpreter: no torch, no CUDA state, no trainer threads
inherited), import the reward by its `package.module:function` path themselves, and die with
the trainer (PR_SET_PDEATHSIG on Linux). A call past its timeout terminates the pool: the run
stops anyway, and a stuck reward must not outlive it.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rlflow.data.rewards import RewardBatch

TRACEBACK_LINES = 12  # last lines of a reward's traceback shown in the error


@dataclass
class Outcome:
    """A reward call's result: `value` (list, or dict of lists, of floats) or an error."""

    value: object = None
    error: str | None = None  # "raised ValueError: ...", "returned ...", ...
    kind: str | None = None  # raised | bad-value | timeout | import
    row: int = 0  # the rollout the error is about, when known
    notes: tuple[str, ...] = field(default_factory=tuple)


def load_function(spec: str, search_path: Sequence[str] = ()):
    """`package.module:function` -> the function (imports the module)."""
    module_name, _, attr = spec.partition(":")
    for entry in reversed(search_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    module = importlib.import_module(module_name)
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"{spec} is a {type(fn).__name__}, not a function")
    return fn


_LOADED: dict[str, object] = {}


def call_reward(spec: str, batch: RewardBatch, search_path: Sequence[str] = ()) -> Outcome:
    """Import (once) and call one reward on one batch; every failure becomes an Outcome."""
    try:
        fn = _LOADED.get(spec) or load_function(spec, search_path)
        _LOADED[spec] = fn
    except Exception as exc:
        return Outcome(
            error=f"cannot be imported: {type(exc).__name__}: {exc}",
            kind="import",
            notes=_traceback_note(exc),
        )
    try:
        value = fn(batch)
    except Exception as exc:
        return Outcome(
            error=f"raised {type(exc).__name__}: {exc}", kind="raised", notes=_traceback_note(exc)
        )
    return _plain(value, len(batch))


def _plain(value, n: int) -> Outcome:
    """Check the returned shape and convert to plain floats (NaN checks are the caller's)."""
    expected = f"a list of {n} floats (one per rollout) or a dict of name -> such a list"
    if isinstance(value, Mapping):
        if not value:
            return Outcome(error=f"returned an empty dict, not {expected}", kind="bad-value")
        out = {}
        for key, values in value.items():
            converted = _floats(values, n, f"component {key!r}", expected)
            if isinstance(converted, Outcome):
                return converted
            out[str(key)] = converted
        return Outcome(value=out)
    converted = _floats(value, n, "", expected)
    return converted if isinstance(converted, Outcome) else Outcome(value=converted)


def _floats(values, n: int, label: str, expected: str) -> list[float] | Outcome:
    what = f"{label} " if label else ""
    if isinstance(values, str | bytes) or not hasattr(values, "__len__"):
        return Outcome(
            error=f"returned {what}{type(values).__name__}, not {expected}", kind="bad-value"
        )
    if len(values) != n:
        return Outcome(
            error=f"returned {what}{len(values)} values for {n} rollouts; expected {expected}",
            kind="bad-value",
        )
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool | str | bytes) or not hasattr(v, "__float__"):
            return Outcome(
                error=f"returned {what}{v!r} (a {type(v).__name__}), not a float",
                kind="bad-value",
                row=i,
            )
        out.append(float(v))
    return out


def _traceback_note(exc: BaseException) -> tuple[str, ...]:
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    shown = lines[-TRACEBACK_LINES:]
    return ("traceback (last lines):\n" + "\n".join("      " + line for line in shown),)


class RewardPool:
    """`num_workers` spawned processes; `run` splits a batch across them, one call each."""

    def __init__(self, num_workers: int, search_path: Sequence[str]):
        self.num_workers = num_workers
        context = multiprocessing.get_context("spawn")
        self._pool = context.Pool(
            num_workers, initializer=_init_worker, initargs=(list(search_path), os.getpid())
        )

    def run(self, spec: str, batch: RewardBatch, timeout_s: float) -> Outcome:
        n = len(batch)
        size = max(1, math.ceil(n / self.num_workers))
        starts = list(range(0, n, size)) or [0]
        pending = [
            (
                start,
                self._pool.apply_async(
                    _worker_call, (spec, batch.rows(slice(start, start + size)))
                ),
            )
            for start in starts
        ]
        deadline = time.monotonic() + timeout_s
        outcomes = []
        for start, result in pending:
            try:
                outcome = result.get(timeout=max(0.0, deadline - time.monotonic()))
            except multiprocessing.TimeoutError:
                self.close()
                return Outcome(
                    error=f"did not return within scoring.timeout_s={timeout_s:g} s "
                    f"(a call on {min(size, n - start)} rollouts)",
                    kind="timeout",
                    row=start,
                )
            if outcome.error is not None:
                outcome.row += start
                return outcome
            outcomes.append(outcome.value)
        return _joined(outcomes)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def _joined(values: list) -> Outcome:
    if all(isinstance(v, list) for v in values):
        return Outcome(value=[x for v in values for x in v])
    if all(isinstance(v, dict) for v in values) and len({tuple(v) for v in values}) == 1:
        return Outcome(value={k: [x for v in values for x in v[k]] for k in values[0]})
    return Outcome(
        error="returned a list for some batches and a dict (or dicts with different keys) for "
        "others",
        kind="bad-value",
    )


def _init_worker(search_path: list[str], parent_pid: int) -> None:
    try:  # die with the trainer, even on SIGKILL (Linux)
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)
    for entry in reversed(search_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)


def _worker_call(spec: str, batch: RewardBatch) -> Outcome:
    return call_reward(spec, batch)
