"""Running rewards from user code: in this process, or in worker processes of their own.

Workers are spawned (a fresh interpreter: no torch, no CUDA state, no trainer threads
inherited), import the reward by its `package.module:function` path themselves, and die with
the trainer (PR_SET_PDEATHSIG on Linux, SIGKILL at exit). The pool waits on each busy worker's
pipe and on its process at once, so a worker that dies in a call (a crash in native code, an
exit from C, the kernel's OOM killer) is noticed the moment it dies, never after
scoring.timeout_s. multiprocessing.Pool, used before, could not: it replaced a dead worker
silently, lost its task, and its terminate() then hung on the task queue's lock.

A reward that calls sys.exit()/exit() or os._exit() fails like one that raises: os._exit is
refused while a reward runs, here and in the workers. In a worker, KeyboardInterrupt is the
reward's own (the workers ignore SIGINT).

The workers ignore SIGHUP, SIGUSR1, SIGTERM and SIGINT: the launcher sends the time-limit
warning and its stop to the rank's whole process group, and the rank, not its reward workers,
decides when to stop (it finishes the step and saves).
"""

from __future__ import annotations

import atexit
import importlib
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # its exit hook (join every child) is registered before ours
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from rlflow.data.rewards import RewardBatch

TRACEBACK_LINES = 12  # last lines of a reward's traceback shown in the error
WORKER_IGNORES = (signal.SIGHUP, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
LONGEST_WAIT_S = 3600.0  # one wait for a worker (a longer scoring.timeout_s waits again)


@dataclass
class Outcome:
    """A reward call's result: `value` (list, or dict of lists, of floats) or an error."""

    value: object = None
    error: str | None = None  # "raised ValueError: ...", "returned ...", ...
    kind: str | None = None  # raised | exited | bad-value | timeout | import | died
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


class _ExitCalled(BaseException):
    """os._exit(code), refused while a reward runs (a BaseException: `except Exception` in the
    reward does not swallow it)."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


@contextmanager
def _exits_refused():
    real, owner = os._exit, os.getpid()

    def refuse(code):
        if os.getpid() != owner:  # a child the reward forked exits as it asked
            real(code)
        raise _ExitCalled(code)

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def call_reward(
    spec: str, batch: RewardBatch, search_path: Sequence[str] = (), in_worker: bool = False
) -> Outcome:
    """Import (once) and call one reward on one batch; every failure becomes an Outcome."""
    caught = (Exception, SystemExit, _ExitCalled) + ((KeyboardInterrupt,) if in_worker else ())
    try:
        with _exits_refused():
            fn = _LOADED.get(spec) or load_function(spec, search_path)
        _LOADED[spec] = fn
    except caught as exc:
        what = _describe(exc).removeprefix("raised ")
        return Outcome(
            error=f"cannot be imported: {what}", kind="import", notes=_traceback_note(exc)
        )
    try:
        with _exits_refused():
            value = fn(batch)
    except caught as exc:
        kind = "exited" if isinstance(exc, SystemExit | _ExitCalled) else "raised"
        return Outcome(error=_describe(exc), kind=kind, notes=_traceback_note(exc))
    return _plain(value, len(batch))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}) (or exit())"
    if isinstance(exc, _ExitCalled):
        return f"called os._exit({exc.code!r})"
    return f"raised {type(exc).__name__}" + (f": {exc}" if str(exc) else "")


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
    shape = getattr(values, "shape", None)
    if isinstance(shape, tuple) and len(shape) != 1:
        return Outcome(
            error=f"returned {what}an array of shape {shape}, not {expected}", kind="bad-value"
        )
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
        problem = None
        if isinstance(v, bool | str | bytes) or not hasattr(v, "__float__"):
            problem = f"{_shown(v)} (a {type(v).__name__}), not a float"
        else:
            try:
                out.append(float(v))
            except Exception as exc:  # a user type's __float__: its own error, reported
                problem = f"a {type(v).__name__} whose float() raised {type(exc).__name__}: {exc}"
        if problem:
            return Outcome(error=f"returned {what}{problem}", kind="bad-value", row=i)
    return out


def _shown(value, limit: int = 80) -> str:
    try:
        text = repr(value)
    except Exception:  # a user type's __repr__ may fail too
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _traceback_note(exc: BaseException) -> tuple[str, ...]:
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    shown = lines[-TRACEBACK_LINES:]
    return ("traceback (last lines):\n" + "\n".join("      " + line for line in shown),)


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection


class RewardPool:
    """`num_workers` spawned processes; `run` splits a batch across them, one call each."""

    def __init__(self, num_workers: int, search_path: Sequence[str]):
        self.num_workers = num_workers
        self._context = multiprocessing.get_context("spawn")
        self._search_path = list(search_path)
        self._workers: list[_Worker] = []
        self._processes: list = []  # every worker started, killed at exit (they ignore SIGTERM)
        atexit.register(_kill, self._processes)
        self._replace_dead()  # start them now: the first step does not wait for the spawn

    def run(self, spec: str, batch: RewardBatch, timeout_s: float) -> Outcome:
        self._replace_dead()
        n = len(batch)
        size = max(1, math.ceil(n / self.num_workers))
        busy: dict[int, tuple[_Worker, int]] = {}
        for index, start in enumerate(range(0, n, size) if n else [0]):
            worker = self._workers[index]
            try:
                worker.conn.send((spec, batch.rows(slice(start, start + size))))
            except OSError:
                pass  # it died just now: its sentinel says so below
            busy[index] = (worker, start)
        deadline = time.monotonic() + timeout_s
        values: dict[int, object] = {}
        while busy:
            left = deadline - time.monotonic()
            waiting = [w.conn for w, _ in busy.values()] + [
                w.process.sentinel for w, _ in busy.values()
            ]
            ready = multiprocessing.connection.wait(
                waiting, timeout=min(max(left, 0), LONGEST_WAIT_S)
            )
            if not ready and left <= 0:
                start = min(s for _, s in busy.values())
                self.close()  # the run stops anyway, and a stuck reward must not outlive it
                return Outcome(
                    error=f"did not return within scoring.timeout_s={timeout_s:g} s "
                    f"(a call on {min(size, n - start)} rollouts)",
                    kind="timeout",
                    row=start,
                )
            for index, (worker, start) in list(busy.items()):
                if worker.conn not in ready and worker.process.sentinel not in ready:
                    continue
                del busy[index]
                outcome = _receive(worker)
                if outcome is None:
                    outcome = Outcome(
                        error=f"killed its worker process ({_death(worker.process)})",
                        kind="died",
                    )
                if outcome.error is not None:
                    outcome.row += start
                    self.close()  # the other workers' results would answer the next call
                    return outcome
                values[start] = outcome.value
        return _joined([values[start] for start in sorted(values)])

    def _replace_dead(self) -> None:
        alive = [w for w in self._workers if w.process.is_alive()]
        for worker in self._workers:
            if worker not in alive:
                worker.conn.close()
        self._workers = alive + [self._start() for _ in range(self.num_workers - len(alive))]

    def _start(self) -> _Worker:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=_serve,
            args=(theirs, self._search_path, os.getpid()),
            name="rlflow-reward-worker",
        )
        # Blocked across the spawn (the child inherits the mask), until the worker ignores them:
        # a warning to the process group in between must not kill it.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORES)
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        theirs.close()
        self._processes.append(process)
        return _Worker(process, ours)

    def close(self) -> None:
        """Kill the workers (they ignore SIGTERM); the next `run` starts new ones."""
        _kill(self._processes)
        for worker in self._workers:
            worker.conn.close()
        self._workers = []
        self._processes.clear()


def _kill(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


def _receive(worker: _Worker) -> Outcome | None:
    """The worker's answer, or None when it died without one."""
    try:
        if worker.conn.poll():
            return worker.conn.recv()
    except (EOFError, OSError):
        pass
    return None


def _death(process) -> str:
    """How a worker ended: "SIGSEGV (a crash in native code)", "exit code 0", ..."""
    process.join()
    code = process.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        why = {
            "SIGSEGV": "a crash in native code",
            "SIGBUS": "a crash in native code",
            "SIGABRT": "aborted",
            "SIGKILL": "killed: the kernel's OOM killer, or kill -9",
        }.get(name)
        return f"{name}" + (f", {why}" if why else "")
    return f"exit code {code}: an exit outside Python, e.g. exit() from C"


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


def _serve(conn, search_path: list[str], parent_pid: int) -> None:
    """A worker: answer (spec, batch) calls until the trainer closes the pipe or dies."""
    import faulthandler

    faulthandler.enable()  # a crash in a reward prints its Python stack into the rank's log
    for signum in WORKER_IGNORES:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_IGNORES)
    try:  # die with the trainer, even on SIGKILL (Linux)
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)
    for entry in reversed(search_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    while True:
        try:
            spec, batch = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(call_reward(spec, batch, in_worker=True))
