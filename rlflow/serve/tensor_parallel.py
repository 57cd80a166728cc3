"""Serving with a tensor-parallel engine: the leader decides, the other ranks follow its plans.

Under tensor parallelism every rank of the engine holds a slice of each layer, and every prefill
and decode step is a collective: the ranks must run the same rows, admitted, retired and
preempted at the same points. Only the group's first rank (the leader) serves HTTP and runs the
engine's loop (rlflow/serve/engine.py); before each interval's first collective it sends the
other ranks (followers) a `Plan` over a gloo group of the engine's ranks:

* `retired`: the rows of each retire since the last plan, in order (rows that finished, by a stop
  token or a stop string only the leader's tokenizer sees; cancelled rows; refused rows);
* `rows`: the batch after them, which a follower checks it holds too (a divergence ends the
  job naming both lists, never a silent wrong batch);
* `new`: the rows admitted now, with their prompts (ids and media: a follower prefills the same
  packed prompts), sampling parameters and seeds.

The rest is the same computation on every rank: preemption (`grow`) depends on the cache's
state alone; sampling draws from the same gathered logits with each row's own seed, so every
rank samples the same tokens. `end`: the leader's step is over (NeMo Gym's tasks ended); the
followers return to the job's loop (weight sync) and follow again at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlflow.errors import Diagnostic, RlflowError
from rlflow.generation.base import SamplingParams
from rlflow.model.media import Prompt
from rlflow.serve.batch import Row, RunningBatch, prompt_key
from rlflow.serve.device_rows import CHECK_EVERY
from rlflow.serve.requests import Request


@dataclass
class NewRow:
    uid: int
    request: int  # the leader's request, by number in this plan (its rows share one Request)
    index: int  # which choice
    prompt: int  # the prompt's slot in Plan.prompts (rows of one prompt share one prefill)


@dataclass
class PlannedRequest:
    params: SamplingParams
    seeds: list[int]


@dataclass
class Plan:
    retired: list[list[int]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    new: list[NewRow] = field(default_factory=list)
    requests: list[PlannedRequest] = field(default_factory=list)
    prompts: list[tuple[Prompt, list[int]]] = field(default_factory=list)
    end: bool = False
    close: bool = False  # (with end) the server is shutting down: the followers leave too


class PlanSender:
    """The leader's side, called from the engine's thread: `group` is a CrossGroup (gloo) of the
    engine's tensor-parallel ranks, the leader's job rank first."""

    def __init__(self, group):
        self.group = group
        self.sent = 0

    def send(
        self, batch: RunningBatch, new: list[Row], end: bool = False, close: bool = False
    ) -> None:
        plan = Plan(batch.journal[:], [r.uid for r in batch.rows], end=end, close=close)
        batch.journal.clear()
        requests: dict[int, int] = {}
        prompts: dict[object, int] = {}
        for row in new:
            request = row.request
            if id(request) not in requests:
                requests[id(request)] = len(plan.requests)
                plan.requests.append(PlannedRequest(request.params, list(request.seeds)))
            key = prompt_key(request)
            if key not in prompts:
                prompts[key] = len(plan.prompts)
                plan.prompts.append((request.prompt, list(request.prompt_ids)))
            plan.new.append(NewRow(row.uid, requests[id(request)], row.index, prompts[key]))
        self.group.broadcast_object(plan, self.group.ranks[0])
        self.sent += 1


class Follower:
    """A follower rank's engine: the same RunningBatch as the leader's, stepped by its plans."""

    def __init__(self, batch: RunningBatch, group):
        self.batch, self.group = batch, group
        self.plans = 0  # followed so far (a test and the log read it)

    def follow(self, keep_alive=None) -> bool:
        """Run the leader's plans until one says the step is over; True if the server closed."""
        batch = self.batch
        while True:
            plan = self.group.broadcast_object(None, self.group.ranks[0], keep_alive=keep_alive)
            self.plans += 1
            for uids in plan.retired:
                batch.retire(self._rows(uids))
            mine = [r.uid for r in batch.rows]
            if mine != plan.rows:
                raise RlflowError(
                    Diagnostic(
                        "serve.tensor-parallel",
                        f"tensor-parallel serving diverged: the leader's batch holds rows "
                        f"{plan.rows}, this rank's {mine}",
                        help="a bug in rlflow: please report it with both ranks' logs",
                    )
                )
            if plan.end:
                return plan.close
            new = self._new_rows(plan)
            if new:
                batch.prefill(new, 0)
            if not batch.rows:
                continue
            batch.grow(CHECK_EVERY)  # preempts what the leader's grow preempts
            if not batch.rows:
                continue
            batch.run(CHECK_EVERY)
            batch.collect(CHECK_EVERY)  # (which rows stopped: the leader's next plan says)

    def _rows(self, uids: list[int]) -> list[Row]:
        by_uid = {r.uid: r for r in self.batch.rows}
        return [by_uid[u] for u in uids if u in by_uid]

    @staticmethod
    def _new_rows(plan: Plan) -> list[Row]:
        prompts = plan.prompts
        requests: dict[int, Request] = {}
        rows = []
        for new in plan.new:
            request = requests.get(new.request)
            if request is None:
                planned = plan.requests[new.request]
                prompt, ids = prompts[new.prompt]
                request = Request(prompt, ids, planned.params, planned.seeds)
                requests[new.request] = request
            rows.append(Row(request, new.index, len(request.prompt_ids), uid=new.uid))
        return rows
