"""Rollouts from generation ranks of their own (`generation.placement: separate`).

The trainers and the generation ranks (rlflow.train.generation_role.generator) run one fixed protocol over the
job's cross-role groups (rlflow.parallel.cross_group). For step k of the trainer:

    trainer ranks                              generation ranks
    order: "batch k" -----------------------> batch k ready? (generate it now if not)
    wait for batch k <----------------------- batch k: its rollouts, their weights' version
    logprobs, update (weights -> version k)   generate ahead: batches up to k + max_staleness
    wait for "ready" <----------------------- ready
    weights of version k -------------------> receive, reshard into their own shards
    fingerprints, compared by job rank 0 <--> fingerprints

Batch s is generated with the weights of version max(start, s - 1 - max_staleness) (`Schedule`):
0 gives synchronous GRPO on separate ranks, 1 one-step-off (batch k+1 is generated while step k
trains), N at most N steps stale. The schedule depends on nothing but the step, so a run with a
fixed seed does the same thing twice. The trainer checks every batch's version against it and
logs the lag (async/staleness); a resumed run restarts the schedule from its checkpoint's
weights (`start`), so its first batches are fresher than the uninterrupted run's.

It checks every model turn too (`Completion.token_versions`: a multi-turn trajectory records
the weights of each turn): a turn staler than max_staleness, or newer than the trainer's
weights, stops the run naming it (`async_grpo.on_stale_turn: stop`) or is masked out of the
loss (`drop`; its tokens stay in the context), counted in async/stale_turns and
async/stale_tokens; async/turn_staleness_max is the stalest turn trained.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rlflow import parallel
from rlflow.environment.trajectory import turn_versions
from rlflow.errors import Diagnostic, RlflowError
from rlflow.generation.base import Completion
from rlflow.model.media import Prompt
from rlflow.train import watchdog
from rlflow.train.collect import RolloutContext, Rollouts
from rlflow.train.generation_role.weight_sync import WeightSync, check_layouts, synced_layouts


@dataclass(frozen=True)
class Schedule:
    """Which weights generate which batch, and after which steps the weights move."""

    staleness: int  # async_grpo.max_staleness
    start: int  # the step the run (re)started at: the oldest weights the generators have
    last: int  # grpo.max_num_steps

    def version_for(self, batch: int) -> int:
        return max(self.start, batch - 1 - self.staleness)

    def sync_after(self, step: int) -> bool:
        """Does a later batch need the weights of `step`?"""
        return step + 1 + self.staleness <= self.last

    def ahead(self, sent: int) -> int:
        """The last batch that may be generated once batch `sent` has been handed over."""
        return min(self.last, sent + self.staleness)


@dataclass
class RolloutBatch:
    """One step's rollouts as the generation ranks hand them over (picklable)."""

    step: int
    weight_version: int
    groups: list[tuple[Prompt, list[Completion], list[float]]]  # kept groups, prompt order
    sums: dict[str, float]  # Rollouts.sums, over all generation replicas
    sampler_state: dict  # the prompt sampler after this batch: what a checkpoint must hold
    seconds: dict[str, float] = field(default_factory=dict)  # the generators' phase times
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's (env/*)
    # partial rollouts: each generation replica's rows in flight after this batch (replica
    # order), what a checkpoint of this step must hold; None without partial rollouts
    partial: list[dict] | None = None

    def share(self, dp_rank: int, dp_size: int) -> Rollouts:
        """A training data-parallel rank's rollouts: groups dp_rank, dp_rank + dp_size, ... (as
        a colocated rank takes prompts); the sums count once, on data-parallel rank 0."""
        mine = self.groups[dp_rank::dp_size]
        completions = [c for _, group, _ in mine for c in group]
        return Rollouts(
            prompts=[p for p, group, _ in mine for _ in group],
            completions=completions,
            advantages=[a for _, _, adv in mine for a in adv],
            sums=self.sums if dp_rank == 0 else dict.fromkeys(self.sums, 0.0),
            weight_versions=[self.weight_version] * len(completions),
        )


class Link:
    """The cross-role groups of one job, built in the same order on every rank: the job-wide
    message group, the rollout group (first generation rank -> trainers) and the weight sync.
    Job rank 0 also checks that both sides hold the same weights (names, shapes, layouts)."""

    def __init__(self, policy, recipe):
        me, placement = parallel.info(), parallel.placement()
        self.job = parallel.job_group()
        self.leader = placement.generation[0]
        mine = synced_layouts(policy, me.tp_size) if me.job_rank == 0 else None
        layouts = self.job.broadcast_object(mine, src=0, keep_alive=watchdog.beat)
        problems = check_layouts(layouts, policy, me.tp_size) if me.role == "generate" else []
        reports = self.job.all_gather_object(problems)
        if me.job_rank == 0 and any(reports):
            raise _layout_error(reports)
        self.rollouts = parallel.cross_group((self.leader, *placement.training), device=False)
        self.sync = WeightSync(policy, layouts, recipe.generation.sync_bucket_mb)
        # NeMo Gym: every generation engine's server answers Gym's turns (rlflow/train/gym/):
        # `generators` are the serving ranks (each engine's first tensor-parallel rank);
        # `engine_ranks`, under tensor parallelism, this rank's engine's ranks, where the
        # others follow the first one's plans (rlflow/serve/tensor_parallel.py)
        self.generators = self.engine_ranks = None
        if recipe.environment.kind == "gym":
            tp, ranks = recipe.generation.tensor_parallel_size, placement.generation
            self.generators = parallel.cross_group(ranks[::tp], device=False)
            for first in range(0, len(ranks), tp) if tp > 1 else ():
                group = parallel.cross_group(ranks[first : first + tp], device=False)
                self.engine_ranks = group or self.engine_ranks

    def message(self, obj=None, *, src: int):
        """A small message from job rank `src` to every rank, waiting as long as it takes."""
        return self.job.broadcast_object(obj, src, keep_alive=watchdog.beat)

    def weights(self, version: int) -> float:
        """Both sides: the sync of `version`, then the fingerprint check; seconds spent."""
        seconds = self.sync.run(version)
        self.sync.verify(version)
        return seconds


class RemoteRollouts:
    """The trainer's side: orders batches, checks their versions, sends the weights."""

    def __init__(self, link: Link, context: RolloutContext):
        self.link, self.context, self.recipe = link, context, context.recipe
        self.schedule: Schedule | None = None
        self.sync_seconds = 0.0
        self.turn_metrics: dict[str, float] = {}  # the last batch's per-turn staleness
        self.batch_metrics: dict[str, float] = {}  # the last batch's environment metrics
        self.partial: list[dict] | None = None  # the generators' rows in flight (checkpointed)

    def start(self, step: int) -> None:
        """After the warm start or the resume: the weights of `step` and the sampler's state."""
        state = {"step": step, "sampler": self.context.sampler.state_dict()}
        self.link.message({**state, "partial": self.partial}, src=0)
        watchdog.beat("weight_sync", step)
        self.sync_seconds = self.link.weights(step)
        self.schedule = Schedule(
            self.recipe.async_grpo.max_staleness, step, self.recipe.grpo.max_num_steps
        )

    def collect(self, step: int, timer) -> Rollouts:
        self.link.message({"want": step}, src=0)
        with timer("wait_rollouts"):
            batch = self.link.rollouts.broadcast_object(
                None, self.link.leader, keep_alive=watchdog.beat
            )
        self._check(batch, step)
        batch = self._check_turns(batch, step)
        self.batch_metrics = batch.metrics
        self.partial = batch.partial
        self.context.sampler.load_state_dict(batch.sampler_state)
        for phase, seconds in batch.seconds.items():
            timer.seconds[phase] = timer.seconds.get(phase, 0.0) + seconds
        info = self.context.info
        return batch.share(info.dp_rank, info.dp_size)

    def after_update(self, step: int, timer) -> None:
        if not self.schedule.sync_after(step):
            return
        with timer("wait_generation"):
            self.link.message(src=self.link.leader)  # the generators are done generating ahead
        with timer("weight_sync"):
            self.link.weights(step)

    def step_metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        version = min(rollouts.weight_versions, default=step - 1)
        return {
            "async/weight_version": float(version),
            "async/staleness": float(step - 1 - version),
            **self.turn_metrics,
            **self.batch_metrics,
        }

    def finish(self, exit_code: int) -> None:
        """Tell the generation ranks to leave, with the trainers' exit code."""
        self.link.message({"stop": exit_code}, src=0)

    def state_dict(self) -> dict | None:
        """Partial rollouts: the generation replicas' rows in flight after the last batch
        trained, checkpointed beside the trainer's weights (None without partial rollouts)."""
        return None if self.partial is None else {"generators": self.partial}

    def load_state_dict(self, state: dict | None) -> int:
        """Take back the generators' rows in flight (sent with the start message); return how
        many are unfinished."""
        self.partial = (state or {}).get("generators")
        return sum(
            r["finish_reason"] is None
            for replica in self.partial or ()
            for g in replica.get("groups", ())
            for r in g["rows"]
        )

    def _check(self, batch: RolloutBatch, step: int) -> None:
        """The tripwire: rollouts of the wrong step, from weights staler than max_staleness, or
        newer than the trainer's own, stop the run."""
        staleness = step - 1 - batch.weight_version
        expected = self.schedule.version_for(step)
        if batch.step == step and batch.weight_version == expected:
            return
        limit = self.recipe.async_grpo.max_staleness
        raise RlflowError(
            Diagnostic(
                "async.stale-rollouts",
                f"step {step} got rollouts of batch {batch.step} generated with weights of "
                f"version {batch.weight_version} ({staleness} steps old; "
                f"async_grpo.max_staleness is {limit}, the schedule says version {expected})",
                help="the generation ranks are out of step with the trainer: the run stops "
                "rather than train on rollouts from the wrong weights; resume from the last "
                "checkpoint",
            )
        )

    def _check_turns(self, batch: RolloutBatch, step: int) -> RolloutBatch:
        """Every model turn within max_staleness of the weights trained (version step - 1)
        and no newer; a turn outside stops the run or, with on_stale_turn: drop, is masked out
        of the loss. The whole batch on every training rank, so the counts agree."""
        cfg = self.recipe.async_grpo
        newest, oldest = step - 1, step - 1 - cfg.max_staleness
        partial = self.recipe.generation.partial_rollouts
        if partial.enabled:  # a continued row's tokens are older by up to its own bound
            oldest -= partial.max_staleness_steps
        counts = {"async/stale_turns": 0.0, "async/stale_tokens": 0.0}
        worst, groups = 0, []
        for prompt, completions, advantages in batch.groups:
            kept = []
            for c in completions:
                versions = c.token_versions or [batch.weight_version] * len(c.token_ids)
                mask = c.loss_mask or [1] * len(c.token_ids)
                turns = turn_versions(mask, versions)
                bad = [(k, v) for k, v in enumerate(turns) if not oldest <= v <= newest]
                worst = max([worst, *(newest - v for v in turns if v >= oldest)])
                too_new = [(k, v) for k, v in bad if v > newest]
                if too_new or (bad and cfg.on_stale_turn == "stop"):
                    raise _stale_turn(prompt.sample_id, step, (too_new or bad)[0], oldest, newest)
                if bad:
                    dropped = [int(m and v < oldest) for m, v in zip(mask, versions, strict=True)]
                    counts["async/stale_turns"] += len(bad)
                    counts["async/stale_tokens"] += sum(dropped)
                    mask = [m * (1 - d) for m, d in zip(mask, dropped, strict=True)]
                    c = dataclasses.replace(c, loss_mask=mask)
                kept.append(c)
            groups.append((prompt, kept, advantages))
        self.turn_metrics = {**counts, "async/turn_staleness_max": float(worst)}
        return dataclasses.replace(batch, groups=groups)


def _stale_turn(name: str, step: int, bad: tuple[int, int], oldest: int, newest: int):
    turn, version = bad
    return RlflowError(
        Diagnostic(
            "async.stale-turn",
            f"step {step}: model turn {turn} of a trajectory of row `{name}` was generated "
            f"with weights of version {version}; the trainer accepts versions {oldest} to "
            f"{newest} (async_grpo.max_staleness)",
            help="async_grpo.on_stale_turn: drop trains such a trajectory without its stale "
            "turns (counted in async/stale_turns); a turn newer than the trainer's weights is "
            "always an error: the generation ranks are out of step",
        )
    )


def _layout_error(reports: list) -> RlflowError:
    rank, problems = next((r, p) for r, p in enumerate(reports) if p)
    return RlflowError(
        Diagnostic(
            "async.weight-layout",
            f"generation rank {rank} does not hold the trainer's weights: {problems[0]}",
            notes=tuple(problems[1:4]),
            help="both sides load model.checkpoint; a tensor-parallel size that pads the "
            "vocabulary differently also changes shapes: try another "
            "generation.tensor_parallel_size",
        )
    )
