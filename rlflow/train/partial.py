"""Partial rollouts (`generation.partial_rollouts`, docs/partial-rollouts.md): a per-step
generation budget; rows unfinished at it keep their tokens and continue in the next step.

A step (`PartialRollouts.collect`: on the trainers when colocated; with `generation.placement:
separate` on each generation replica, its batches carrying the rows in flight to the trainers'
checkpoints: rlflow/train/generation_role/):
1. stale: a carried row whose first token is more than `max_staleness_steps` weight updates
   older than the weights generating now starts over (its tokens are dropped and counted);
2. draw: one sampler batch of new prompt groups, unless every rank already holds its share of
   complete groups (the ranks agree, so their samplers stay in step);
3. generate: every unfinished row, under the budget (`budget_steps` decode steps; the megatron
   engine also stops a pass once `finished_fraction` of its rows finished). A row that has
   tokens is prefilled again as a continuation (its prompt + its tokens so far); each new token
   records the weight version that produced it (`Completion.token_versions`) and its logprob,
   which the loss corrects for with importance sampling (TIS/MIS). A rank left without a
   complete group runs more rounds within the step, for its one group nearest to complete
   (the other rows keep waiting), until every rank has one;
4. train: complete groups (all G rows finished), oldest first, up to the step's share; they are
   scored and their advantages computed here; the rest wait for a later step.

The rows in flight are the rank's state: `state_dict()` goes beside each checkpoint
(rlflow/train/checkpoint.py, `rollouts_rank<R>.json`), so a stop at the time limit loses none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from rlflow import parallel
from rlflow.generation.base import Completion, GenerationBackend, SamplingParams
from rlflow.model.media import Prompt
from rlflow.train import grpo
from rlflow.train.collect import (
    RolloutContext,
    Rollouts,
    Scored,
    no_signal,
    sampling,
    score_rollouts,
    shaping_penalty,
)


@dataclass
class Row:
    """One rollout, as far as it got: its tokens, their logprobs and weight versions."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # None: unfinished (cut by the budget)

    def completion(self) -> Completion:
        return Completion(
            list(self.token_ids),
            list(self.logprobs),
            self.finish_reason,  # type: ignore[arg-type]
            token_versions=list(self.versions),
        )


@dataclass
class Group:
    """One prompt's G rows; trained once every row finished."""

    index: int  # the sample's row in the training data
    started: int  # the step that drew it
    rows: list[Row]

    @property
    def complete(self) -> bool:
        return all(r.finish_reason is not None for r in self.rows)


def continuation(prompt: Prompt, row: Row) -> Prompt:
    """The prompt a row continues from: its prompt followed by the tokens it has."""
    if not row.token_ids:
        return prompt  # (the same object: a group's new rows share one prefill)
    return dataclasses.replace(prompt, token_ids=prompt.token_ids + tuple(row.token_ids))


def advance(
    backend: GenerationBackend,
    pending: list[tuple[Prompt, Row]],
    params: SamplingParams,
    *,
    budget_steps: int,
    max_new_tokens: int,
    prompt_ids,
) -> int:
    """Generate each unfinished (prompt, row) for at most `budget_steps` decode steps (0: to
    max_new_tokens) and append what came to the row; return the tokens generated.

    A row ends `stop` at a stop token and `length` at max_new_tokens; otherwise it stays
    unfinished. prompt_ids: the policy's (a continuation whose tokens hold a media pad token
    is no valid prompt: that row ends `length` where it is)."""
    version = backend.weight_version
    prompts, rows = [], []
    for prompt, row in pending:
        prompt = continuation(prompt, row)
        try:
            prompt_ids(prompt)
        except ValueError:
            row.finish_reason = "length"
            continue
        prompts.append(prompt)
        rows.append(row)
    if not rows:
        if backend.name == "megatron":  # an expert-parallel engine's peers need this rank
            backend.generate([], params)
        return 0
    remaining = max(max_new_tokens - len(r.token_ids) for r in rows)
    steps = min(budget_steps or remaining, remaining)
    completions = backend.generate(prompts, dataclasses.replace(params, max_new_tokens=steps))
    generated = 0
    for row, c in zip(rows, completions, strict=True):
        room = max_new_tokens - len(row.token_ids)
        ids = c.token_ids[:room]
        row.token_ids += ids
        row.logprobs += c.logprobs[:room]
        row.versions += [version] * len(ids)
        generated += len(ids)
        if c.finish_reason == "stop" and len(c.token_ids) <= room:
            row.finish_reason = "stop"
        elif len(row.token_ids) >= max_new_tokens:
            row.finish_reason = "length"
    return generated


def nearest(groups: list[Group], max_new_tokens: int) -> Group:
    """The group nearest to complete: fewest tokens left to its longest unfinished row (the
    oldest among equals)."""

    def left(g: Group) -> int:
        return max(max_new_tokens - len(r.token_ids) for r in g.rows if r.finish_reason is None)

    return min(groups, key=lambda g: (left(g), g.started))


def drop_stale(groups: list[Group], version: int, max_staleness: int) -> tuple[int, int]:
    """Rows whose first token is more than max_staleness versions older than `version` start
    over; return (rows, tokens) dropped."""
    rows = tokens = 0
    for group in groups:
        for i, row in enumerate(group.rows):
            if row.versions and version - row.versions[0] > max_staleness:
                rows += 1
                tokens += len(row.token_ids)
                group.rows[i] = Row()
    return rows, tokens


_COUNTS = ("rows_carried", "rows_continued", "rows_dropped_stale", "tokens_dropped_stale",
           "groups_waiting", "staleness_sum", "staleness_tokens")  # fmt: skip


class PartialRollouts:
    """A RolloutSource (rlflow/train/collect.py) with partial rollouts: a colocated trainer's,
    or a generation rank's (rlflow/train/generation_role/generator.py)."""

    def __init__(self, context: RolloutContext):
        self.context = context
        self.groups: list[Group] = []  # in flight, oldest first
        self.counts = dict.fromkeys(_COUNTS, 0.0)

    def start(self, step: int) -> None:
        """Nothing to hand over: the engine reads the policy's weights."""

    def collect(self, step: int, timer) -> Rollouts:
        t = self.context
        recipe, info = t.recipe, t.info
        cfg = recipe.generation.partial_rollouts
        want = recipe.grpo.num_prompts_per_step // info.dp_size
        group = parallel.data_parallel_group()
        version = t.backend.weight_version
        counts = dict.fromkeys(_COUNTS, 0.0)
        counts["rows_dropped_stale"], counts["tokens_dropped_stale"] = drop_stale(
            self.groups, version, cfg.max_staleness_steps
        )
        counts["rows_continued"] = sum(
            1 for g in self.groups for r in g.rows if r.token_ids and r.finish_reason is None
        )
        ready = sum(g.complete for g in self.groups)
        if parallel.all_reduce_max(float(ready < want), group):
            G = recipe.grpo.num_generations_per_prompt
            for index in next(t.sampler)[info.dp_rank :: info.dp_size]:
                self.groups.append(Group(int(index), step, [Row() for _ in range(G)]))
        prompts: dict[int, Prompt] = {}

        def prompt_of(g: Group) -> Prompt:  # encoded once per step
            if g.index not in prompts:
                prompts[g.index] = t.encoder.encode(t.train_data[g.index])
            return prompts[g.index]

        scored = Scored()
        generated = rounds = 0
        cap = recipe.generation.max_new_tokens
        with timer("generation"):
            while True:
                live = [g for g in self.groups if not g.complete]
                if rounds:  # a rank without a complete group finishes the nearest one alone
                    alone = live and len(live) == len(self.groups)
                    live = [nearest(live, cap)] if alone else []
                pending = [(prompt_of(g), r) for g in live for r in g.rows
                           if r.finish_reason is None]  # fmt: skip
                params = dataclasses.replace(
                    sampling(t, step, recipe.generation.temperature, rounds),
                    stop_fraction=cfg.finished_fraction,
                )
                generated += advance(
                    t.backend, pending, params, budget_steps=cfg.budget_steps, max_new_tokens=cap,
                    prompt_ids=t.backend.policy.prompt_ids,
                )  # fmt: skip
                if pending:  # (the engine's timings are of its last call)
                    scored.preempted += getattr(t.backend, "last_timings", {}).get("preempted", 0)
                rounds += 1
                waiting = not any(g.complete for g in self.groups)
                if not parallel.all_reduce_max(float(waiting), group):
                    break
        done = sorted((g for g in self.groups if g.complete), key=lambda g: g.started)[:want]
        taken = {id(g) for g in done}
        self.groups = [g for g in self.groups if id(g) not in taken]
        rollouts = self._train_on(done, [prompt_of(g) for g in done], scored, timer)
        counts["rows_carried"] = sum(
            1 for g in self.groups for r in g.rows if r.finish_reason is None
        )
        counts["groups_waiting"] = sum(g.complete for g in self.groups)
        for c in rollouts.completions:
            counts["staleness_sum"] += sum(version - v for v in c.token_versions or ())
            counts["staleness_tokens"] += len(c.token_ids)
        rollouts.sums.update({
            "sampling/extra_rounds": float(rounds - 1) if info.dp_rank == 0 else 0.0,
            "sampling/generated_tokens": float(generated),
        })  # fmt: skip
        self.counts = counts
        return rollouts

    def _train_on(self, done: list[Group], prompts: list[Prompt], scored: Scored, timer):
        """Scores and advantages of the complete groups `done` (prompts: theirs)."""
        t = self.context
        cfg = t.recipe.grpo
        samples = [t.train_data[g.index] for g in done for _ in g.rows]
        completions = [r.completion() for g in done for r in g.rows]
        with timer("reward"):
            # single-turn only (rlflow/rules/partial.py): the rewards read the completions
            texts = [t.encoder.decode(c.token_ids) for c in completions]
            rewards, per_reward, accuracy = score_rollouts(t, samples, completions, texts)
            penalty = shaping_penalty(t.recipe, completions)
            if penalty is not None:
                rewards = [r + p for r, p in zip(rewards, penalty, strict=True)]
                per_reward["overlong_penalty"] = penalty
        scored.rewards, scored.accuracy, scored.generated = rewards, accuracy, completions
        scored.per_reward = per_reward
        G = cfg.num_generations_per_prompt
        with timer("advantages"):
            table = torch.tensor(rewards, dtype=torch.float32).view(len(done), G)
            advantages = grpo.group_advantages(
                table, cfg.use_leave_one_out_baseline, cfg.normalize_rewards
            ).flatten()
        filtered = sum(no_signal(row) for row in table.tolist())
        return Rollouts(
            prompts=[p for p, g in zip(prompts, done, strict=True) for _ in g.rows],
            completions=completions,
            advantages=advantages.tolist(),
            sums={
                **scored.sums(),
                "sampling/groups_generated": float(len(done)),
                "sampling/groups_filtered": float(filtered),
                "sampling/preempted_rows": float(scored.preempted),
            },
            weight_versions=[min(c.token_versions or [0]) for c in completions],
        )

    def after_update(self, step: int, timer) -> None:
        with timer("weight_refresh"):
            self.context.backend.refresh_weights(step)

    def step_metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        """partial/*: rows carried to the next step, rows continued from earlier steps, rows
        (and their tokens) dropped as stale, complete groups waiting, and the mean staleness
        (weight updates) of the trained tokens; summed over data-parallel ranks."""
        values = parallel.all_reduce_sum(
            [self.counts[k] for k in _COUNTS], parallel.data_parallel_group()
        )
        totals = dict(zip(_COUNTS, values, strict=True))
        out = {f"partial/{k}": totals[k] for k in _COUNTS[:5]}
        out["partial/mean_staleness"] = totals["staleness_sum"] / max(totals["staleness_tokens"], 1)
        return out

    def finish(self, exit_code: int) -> None:
        """Nobody else to tell."""

    def state_dict(self) -> dict:
        """The rows in flight (JSON): checkpointed beside the weights, one file per rank."""
        return {"groups": [dataclasses.asdict(g) for g in self.groups]}

    def load_state_dict(self, state: dict | None) -> int:
        """Take back the rows in flight of a checkpoint; return how many are unfinished."""
        groups = (state or {}).get("groups", [])
        self.groups = [
            Group(g["index"], g["started"], [Row(**r) for r in g["rows"]]) for g in groups
        ]
        return sum(1 for g in self.groups for r in g.rows if r.finish_reason is None)
