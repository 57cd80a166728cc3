"""Continuous batching on rlflow's Megatron engine: requests join the running batch as rows retire.

`generate()` (rlflow/generation/megatron/engine.py) runs a set of rows known in advance. A server
gets requests one at a time, from many clients, at random times; here one engine thread runs a
loop over the same pieces (the `Decoder`'s packed prefill and decode step, the paged `KVCache`,
the per-row counter-based sampling) in intervals of `CHECK_EVERY` decode steps. At each check
(the host's one sync of the interval) it:

1. retires rows that stopped (stop token, stop string, max_tokens, the context) or whose client
   went away: their blocks go back at once and the last rows move into the holes (no key or
   value moves: only block-table rows);
2. admits waiting requests while batch positions and cache blocks are free: their unique
   prompts (a request's n choices, and identical prompts of different requests: text by its
   ids, media by the prompt cache's shared object) are prefilled once, packed, straight into
   the new rows' cache blocks; the new rows join the batch behind the running ones;
3. grows the rows' block tables for the interval, preempting the last admitted rows when the
   cache is full (they run again later from their prompt, with the same seeds);
4. runs the interval's decode steps with no host sync (rlflow/serve/device_rows.py): each
   samples one token per row with the row's own parameters and its own seed and step (a
   choice's tokens are those `generate()` draws for the same seed, whichever rows share its
   batch), marks stopped rows on the device, and decodes (on a GPU a CUDA graph per batch
   bucket, as in `generate()`).

A stopped row or a cancelled request leaves at the next check (at most CHECK_EVERY steps); a
request's rows finish on the weights they started with: an update (`update_weights`) waits for
them to drain, or refuses them (`generation.server.on_weight_update`).
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlflow.errors import Diagnostic, RlflowError
from rlflow.generation.megatron.kv_cache import blocks_for
from rlflow.generation.megatron.schedule import RESERVE_SHARE
from rlflow.serve.batch import Row, RunningBatch, prompt_key
from rlflow.serve.device_rows import CHECK_EVERY
from rlflow.serve.requests import Request, RequestRefused

# The engine's thread shares the process's GIL with the HTTP threads (parsing, encoding), and
# every torch call releases it: under load, taking it back waits up to the switch interval
# (5 ms by default), so the prefill's hundreds of calls would crawl while requests arrive.
# While an engine runs, a thread holding the GIL is asked to yield after this long instead.
SWITCH_INTERVAL_S = 1e-4
# A prefill has a fixed cost (the vision tower's and the layers' launches, the positions on
# the host): while rows are running, requests that fill less than half of the prefill budget
# wait up to this many checks for others, so a stream of single requests does not prefill one
# at a time between every two intervals.
DEFER_CHECKS = 2
# A tensor-parallel engine's followers wait for its next plan in a gloo collective, which times
# out after watchdog.collective_timeout_s: an idle engine sends an empty plan this often.
PLAN_HEARTBEAT_S = 60.0


@dataclass
class _Update:
    apply: Callable[[], None] | None
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    seen: bool = False
    error: str | None = None  # apply() or the requantization raised: the update did not happen


class ServingEngine:
    """The policy's engine behind a queue: `submit` requests from any thread, one thread steps."""

    def __init__(
        self, policy, pad_token_id: int, *, max_rows: int, context_tokens: int,
        cache_tokens: int, cuda_graphs: bool, compile_decode: bool, on_weight_update: str,
        max_prefill_tokens: int, weight_version: int = 0, plans=None,
    ):  # fmt: skip
        if on_weight_update not in ("finish_old", "refuse"):
            raise ValueError(f"on_weight_update must be finish_old or refuse: {on_weight_update}")
        self.on_weight_update = on_weight_update
        self.max_rows = max_rows
        self.context_tokens = context_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.error: str | None = None  # the last engine failure (requests in flight got it)
        self.batch = RunningBatch(
            policy, pad_token_id, max_rows=max_rows, context_tokens=context_tokens,
            cache_tokens=cache_tokens, cuda_graphs=cuda_graphs, compile_decode=compile_decode,
        )  # fmt: skip
        self.stats = self.batch.stats
        # a tensor-parallel engine: its plans to the other ranks (rlflow/serve/tensor_parallel.py)
        self.plans = plans
        if plans is not None:
            self.batch.journal = []
        # release_followers() asked, not yet sent: (its event, close)
        self._release: tuple[threading.Event, bool] | None = None
        # released (or, with followers, not yet resumed): the followers are away, and no plan
        # (no admission, no heartbeat) may wait for them: `resume_followers()` when they follow
        self._parked = plans is not None
        self._cond = threading.Condition()
        self._waiting: collections.deque[Row] = collections.deque()
        self._update: _Update | None = None
        self.idle_since: float | None = None  # when the engine's thread began waiting for work
        self._deferred = 0  # checks the waiting requests have been deferred (_admissions)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rlflow-serve-engine", daemon=True)
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self._thread.start()

    # --- any thread ----------------------------------------------------------------------------

    def submit(self, request: Request) -> Request:
        """Queue a request (its choices are admitted together); `request.on_done` is called
        from the engine's thread when it finished or failed."""
        if request.n > self.max_rows:
            raise ValueError(f"n={request.n} is more than the server's {self.max_rows} rows")
        rows = [Row(request, i, len(request.prompt_ids)) for i in range(request.n)]
        with self._cond:
            if self._closed:
                raise RuntimeError("the serving engine is closed")
            self._waiting.extend(rows)
            self.stats.requests += 1
            self._cond.notify()
        return request

    def cancel(self, request: Request) -> None:
        """The client went away: its rows leave the batch at the next step (blocks freed)."""
        request.cancelled = True
        with self._cond:
            self._cond.notify()

    def update_weights(self, apply: Callable[[], None] | None, version: int) -> None:
        """Serve `version` from now on: `apply()` (which changes the policy's weights in place;
        None when they already changed) runs in the engine's thread between two steps, after
        the rows in flight finished on the old weights (finish_old) or were refused (refuse).
        Blocks until it ran."""
        update = _Update(apply, version)
        with self._cond:
            self._update = update
            self._cond.notify()
        update.done.wait()
        if update.error is not None:  # fail fast: the caller's job ends, naming the cause
            raise RlflowError(
                Diagnostic(
                    "serve.weight-update",
                    f"the engine could not take the weights of version {version}: {update.error}",
                    help="the engine still serves its previous weights; the traceback is in "
                    "this rank's log",
                )
            )

    def release_followers(self, close: bool = False) -> None:
        """A tensor-parallel engine: tell the other ranks the step is over (they return to the
        job's loop: the weight sync, where this rank's engine must not wait for them). Requests
        in flight or queued (a failed task's late turns: the step's tasks have ended) are
        refused (`step_ended`, HTTP 503); new ones wait until `resume_followers()`. Blocks
        until the engine's thread sent it, between two intervals. A no-op without tensor
        parallelism. close: the server shuts down, the followers leave (`rlflow serve`)."""
        if self.plans is None:
            return
        done = threading.Event()
        with self._cond:
            self._release = (done, close)
            self._cond.notify()
        done.wait()

    def resume_followers(self) -> None:
        """The other ranks follow (from now on, or again: the next step began): requests are
        taken. An engine with followers starts parked, as its followers may not follow yet."""
        with self._cond:
            self._parked = False
            self._cond.notify()

    def pending(self) -> list[Request]:
        """The requests queued or running now (rlflow/serve/job.py answers them before it
        pauses the engine for the trainer)."""
        with self._cond:
            rows = [*self._waiting, *self.batch.rows]
        return list({id(r.request): r.request for r in rows}.values())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        sys.setswitchinterval(self._switch_interval)

    # --- the engine's thread -------------------------------------------------------------------

    def _loop(self) -> None:
        batch = self.batch
        with torch.no_grad():
            while True:
                beat = False  # idle for PLAN_HEARTBEAT_S: the followers hear from us anyway
                with self._cond:
                    if not _has_work(self):
                        # nothing to run: the stats' "idle" seconds (idle_since while it lasts)
                        self.idle_since = time.perf_counter()
                        while not (_has_work(self) or beat):
                            beat = not self._cond.wait(_heartbeat(self))
                        self.stats.add("idle", time.perf_counter() - self.idle_since)
                        self.idle_since = None
                    if self._closed:
                        break
                    release, self._release = self._release, None
                if release is not None:  # the followers' step ends here, between intervals
                    _release(self, *release)
                    continue
                if beat:  # an empty plan: no follower waits on a collective for long
                    self.plans.send(batch, [])
                    continue
                try:
                    self._iterate()
                except (
                    Exception
                ) as exc:  # a failed step: its requests get the error, serving goes on
                    traceback.print_exc(file=sys.stderr)
                    self.error = f"{type(exc).__name__}: {exc}"
                    batch.drop(batch.rows, RequestRefused("engine_error", self.error))
        shutdown = RequestRefused("cancelled", "the server is shutting down")
        batch.drop(batch.rows, shutdown)
        for row in self._waiting:
            row.request.fail(shutdown)

    def _iterate(self) -> None:
        """One interval: retire, admit and prefill, grow, CHECK_EVERY decode steps, check."""
        batch, add, clock = self.batch, self.stats.add, time.perf_counter
        t0 = clock()
        batch.retire([r for r in batch.rows if r.request.cancelled or r.request.done])
        if self._update is not None and self._apply_update():
            return
        t1 = clock()
        add("retire", t1 - t0)
        new = [] if self._update is not None or self._parked else self._admissions()
        t2 = clock()
        add("admit", t2 - t1)
        if self.plans is not None and (new or batch.rows):  # before the interval's collectives
            self.plans.send(batch, new)
            add("plan", clock() - t2)
        if new:
            t2 = clock()
            batch.prefill(new, self.weight_version)
            add("prefill", clock() - t2)
        if not batch.rows:
            return
        t3 = clock()
        preempted = batch.grow(CHECK_EVERY)
        if preempted:
            with self._cond:
                self._waiting.extendleft(reversed(preempted))
        if not batch.rows:
            return
        t4 = clock()
        add("grow", t4 - t3)
        batch.run(CHECK_EVERY)
        t5 = clock()
        add("steps_launch", t5 - t4)
        finished = batch.collect(CHECK_EVERY)
        t6 = clock()
        add("check_sync", t6 - t5)
        batch.retire(finished)
        add("retire", clock() - t6)

    def _apply_update(self) -> bool:
        """True when the update ran now (the iteration starts over)."""
        update, batch = self._update, self.batch
        if not update.seen and update.version == self.weight_version:
            update.seen = True  # a pause, not a change: the rows in flight finish, unmarked
        if not update.seen:
            update.seen = True
            for row in batch.rows:
                row.request.superseded = True
            if self.on_weight_update == "refuse":
                message = (
                    f"the weights changed (version {self.weight_version} -> {update.version}) "
                    "while this request ran; send it again"
                )
                batch.drop(batch.rows, RequestRefused("weight_update", message))
        if batch.rows:
            return False  # finish_old: the rows in flight drain first
        try:
            if update.apply is not None:
                update.apply()
            batch.decoder.requantize()  # (a no-op without FP8 copies)
        except Exception as exc:  # handed to update_weights' caller, not retried forever
            update.error = f"{type(exc).__name__}: {exc}"
            with self._cond:
                self._update = None
            update.done.set()
            raise
        self.weight_version = update.version
        with self._cond:
            self._update = None
        update.done.set()
        return True

    def _admissions(self) -> list[Row]:
        """Whole requests from the queue's front while batch positions, cache blocks (the
        prompt + a quarter of max_tokens each) and the prefill budget last. While rows run, a
        small prefill waits up to DEFER_CHECKS checks for more requests to join it."""
        new: list[Row] = []
        tokens = 0
        prefilled: set = set()  # prompts in this prefill: identical ones are prefilled once
        running = len(self.batch.rows)
        free = self.batch.cache.free_blocks - running  # a block of headroom per running row
        with self._cond:
            while self._waiting:
                head = self._waiting[0]
                if head.request.cancelled or head.request.done:
                    self._waiting.popleft().request.fail(RequestRefused("cancelled", "cancelled"))
                    continue
                # (a request's waiting rows are next to each other: submitted or preempted
                # together)
                group = _leading(self._waiting, head.request)
                reserve = max(head.request.params.max_new_tokens // RESERVE_SHARE, 1)
                need = len(group) * blocks_for(min(head.prompt_len + reserve, self.context_tokens))
                room = running + len(new) + len(group) <= self.max_rows
                key = prompt_key(head.request)
                cost = 0 if key in prefilled else head.prompt_len
                budget = not new or tokens + cost <= self.max_prefill_tokens
                if not (room and budget and (need <= free or not (new or running))):
                    break
                for _ in group:
                    self._waiting.popleft()
                new += group
                free -= need
                tokens += cost
                prefilled.add(key)
            if (
                new and running and self._deferred < DEFER_CHECKS
                and running + len(new) < self.max_rows and tokens < self.max_prefill_tokens // 2
            ):  # fmt: skip
                self._waiting.extendleft(reversed(new))  # a few more next time
                self._deferred += 1
                return []
        self._deferred = 0
        now = time.perf_counter()
        for row in new:  # (a preempted row's request keeps its first admission)
            row.request.times.setdefault("admitted", now)
        return new


def _release(engine: ServingEngine, done: threading.Event, close: bool) -> None:
    """The engine's thread ends the followers' step: what runs or waits is refused, new
    requests wait (parked), the end plan goes out, `release_followers()` returns."""
    engine.batch.drop(engine.batch.rows, _between_steps())
    with engine._cond:
        engine._parked = True
        waiting, engine._waiting = list(engine._waiting), collections.deque()
    for row in waiting:
        row.request.fail(_between_steps())
    engine.plans.send(engine.batch, [], end=True, close=close)
    done.set()


def _heartbeat(engine: ServingEngine) -> float | None:
    """How long the idle engine waits before it sends its followers an empty plan (None:
    forever; no followers, or they are away)."""
    return PLAN_HEARTBEAT_S if engine.plans is not None and not engine._parked else None


def _has_work(engine: ServingEngine) -> bool:
    """Something for the engine's thread: rows, admissible requests, an update, a release."""
    waiting = engine._waiting and not engine._parked
    return bool(engine._closed or waiting or engine.batch.rows or engine._update or engine._release)


def _between_steps() -> RequestRefused:
    return RequestRefused(
        "step_ended", "the tensor-parallel engine is between two training steps; send it again"
    )


def _leading(waiting, request: Request) -> list[Row]:
    """The rows of `request` at the queue's front."""
    return list(itertools.takewhile(lambda r: r.request is request, waiting))
