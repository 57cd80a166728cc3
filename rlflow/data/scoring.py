"""Scorer: a recipe's weighted rewards over a RewardBatch -> totals, components, accuracy.

Built-in rewards run here (pure, fast). Rewards from user code (`package.module:function`)
run in a process pool with a per-call timeout (`scoring.num_workers`, `scoring.timeout_s`),
or here when num_workers is 0. Any failure stops the run with a `RewardError` that names the
reward and shows the rollout: an exception, a NaN or infinite value, a wrong number of
values, or a call past the timeout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlflow.data.reward_pool import RewardPool, call_reward
from rlflow.data.rewards import (
    REWARDS,
    RewardBatch,
    RewardError,
    accuracy_problem,
    is_import_path,
    shorten,
    weight_problems,
)
from rlflow.errors import Diagnostic, RlflowError

if TYPE_CHECKING:
    from rlflow.data.sample import Sample

MAX_ROWS_RETRIED = 64  # rows retried one by one to find the one a failing batch call broke on


@dataclass
class Scores:
    totals: list[float]  # the weighted reward of each rollout
    components: dict[str, list[float]]  # each reward's value, and "reward/part" for dict rewards
    accuracy: list[float]  # the accuracy reward (or component) of each rollout


class Scorer:
    def __init__(
        self,
        weights: Mapping[str, float],
        accuracy: str,
        num_workers: int,
        timeout_s: float,
        search_path: Sequence[str] = (),
    ):
        self.weights = normalized_weights(weights)
        self.accuracy = accuracy
        self.accuracy_reward = accuracy.split("/", 1)[0] if "/" in accuracy else accuracy
        problem = accuracy_problem(accuracy)
        if problem:
            raise RlflowError(problem)
        self.timeout_s = timeout_s
        uses_pool = any(is_import_path(n) for n in (*self.weights, self.accuracy_reward))
        self.pool = (
            RewardPool(num_workers, list(search_path)) if uses_pool and num_workers > 0 else None
        )
        self.search_path = list(search_path)

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def score(self, batch: RewardBatch) -> Scores:
        names = list(self.weights)
        if self.accuracy_reward not in names:
            names.append(self.accuracy_reward)
        components: dict[str, list[float]] = {}
        values: dict[str, list[float]] = {}
        for name in names:
            value, parts = self._run(name, batch)
            values[name] = value
            components[name] = value
            components.update({f"{name}/{part}": v for part, v in parts.items()})
        totals = [
            sum(share * values[name][i] for name, share in self.weights.items())
            for i in range(len(batch))
        ]
        if self.accuracy not in components:
            raise RlflowError(
                Diagnostic(
                    "reward.accuracy-missing",
                    f"`scoring.accuracy` is `{self.accuracy}`, but the reward returned the "
                    f"components {', '.join(k for k in components if '/' in k) or 'none'}",
                    help="name a reward, or reward/component for a reward that returns a dict",
                )
            )
        return Scores(totals, components, components[self.accuracy])

    def _run(self, name: str, batch: RewardBatch) -> tuple[list[float], dict[str, list[float]]]:
        """One reward over the batch: (its value per rollout, its named components)."""
        if not is_import_path(name):
            return _run_builtin(name, batch), {}
        outcome = self._call(name, batch)
        if outcome.error is not None:
            self._raise_for_failure(name, batch, outcome)
        return _checked(name, outcome.value, batch)

    def _raise_for_failure(self, name: str, batch: RewardBatch, outcome) -> None:
        """Find the rollout the reward fails on (retrying rows one by one) and raise."""
        row = outcome.row
        if outcome.kind in RETRIED and len(batch) > 1:
            for i in range(min(len(batch), MAX_ROWS_RETRIED)):
                alone = self._call(name, batch.rows([i]))
                if alone.error is not None:
                    row, outcome = i, alone
                    break
            else:
                outcome.notes = (*outcome.notes, "no row failed when retried alone")
        notes = [*outcome.notes, *_sample_notes(batch, row)]
        raise RewardError(
            name,
            batch.sample_ids[row],
            batch.completions[row],
            outcome.error,
            _help(name, outcome.kind, self.timeout_s),
            notes,
        )

    def _call(self, name: str, batch: RewardBatch):
        if self.pool is not None:
            return self.pool.run(name, batch, self.timeout_s)
        return call_reward(name, batch, self.search_path)


RETRIED = ("raised", "exited", "died")  # failures a single row can reproduce


def _help(name: str, kind: str | None, timeout_s: float) -> str:
    if kind == "timeout":
        return (
            f"make `{name}` faster, or raise scoring.timeout_s (now {timeout_s:g} s) "
            "or scoring.num_workers"
        )
    if kind == "import":
        return "check the import path in `rewards:` (`rlflow submit --dry-run` checks it)"
    if kind == "exited":
        return f"a reward returns its values: remove the exit from `{name}` (traceback above)"
    if kind == "died":
        return (
            f"`{name}` ran in a worker process that ended mid-call: a crash in native code, an "
            "exit from C, or the machine out of memory. Run it on this row alone to see why "
            "(scoring.num_workers=0 runs rewards in the trainer, which prints a crash's stack)"
        )
    return f"fix `{name}` (its traceback is above the sample) or the row's data"


def normalized_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Recipe weights -> shares of the rewards that count (weight > 0), summing to 1."""
    problems = weight_problems(weights)
    if problems:
        raise RlflowError([problem for _, problem in problems])
    total = sum(weights.values())
    return {name: w / total for name, w in weights.items() if w > 0}


def _run_builtin(name: str, batch: RewardBatch) -> list[float]:
    fn = REWARDS[name]
    values = []
    for i, (completion, answer) in enumerate(zip(batch.completions, batch.answers, strict=True)):
        try:
            value = fn(completion, answer)
        except Exception as exc:
            raise RewardError(
                name,
                batch.sample_ids[i],
                completion,
                f"raised {type(exc).__name__}: {exc}",
                help=f"fix the reward `{name}` (traceback above) or the row's "
                f"reference answer {answer!r}",
            ) from exc
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise RewardError(
                name,
                batch.sample_ids[i],
                completion,
                f"returned {value!r}, not a number in [0, 1]",
                help=f"make `{name}` return a float between 0 and 1",
            )
        values.append(float(value))
    return values


def _checked(name: str, value, batch: RewardBatch) -> tuple[list[float], dict[str, list[float]]]:
    """A user reward's return value -> (value per rollout, components); NaN/inf are errors."""
    parts = dict(value) if isinstance(value, Mapping) else {}
    lists = parts if parts else {"": value}
    for part, values in lists.items():
        label = f"component `{part}` " if part else ""
        for i, v in enumerate(values):
            if not math.isfinite(v):
                raise RewardError(
                    name,
                    batch.sample_ids[i],
                    batch.completions[i],
                    f"returned {label}{v!r}",
                    help=f"make `{name}` return a finite float for every rollout",
                    notes=_sample_notes(batch, i),
                )
    if parts:
        total = [sum(vs[i] for vs in parts.values()) for i in range(len(batch))]
        return total, {str(k): list(v) for k, v in parts.items()}
    return list(value), {}


def _sample_notes(batch: RewardBatch, i: int) -> list[str]:
    return [
        f"prompt: {shorten(batch.prompts[i])}",
        f"answer: {batch.answers[i]!r}, media: {batch.media[i]}, "
        f"finish_reason: {batch.finish_reasons[i]}, completion_tokens: "
        f"{batch.completion_tokens[i]}",
        f"fields: {_clipped(repr(batch.fields[i]))}",
    ]


def _clipped(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 5] + " ...}"


def score(
    completions: Sequence[str], samples: Sequence[Sample], weights: Mapping[str, float]
) -> tuple[list[float], dict[str, list[float]], list[bool]]:
    """Score rollouts in this process: (weighted totals, each reward's scores, exact_match).

    A convenience over `Scorer` for built-in rewards (no prompt or finish reason: rewards that
    need them get empty text and "stop").
    """
    batch = RewardBatch.build(
        [""] * len(completions),
        completions,
        [0] * len(completions),
        ["stop"] * len(completions),
        samples,
    )
    with Scorer(weights, accuracy="exact_match", num_workers=0, timeout_s=0) as scorer:
        scores = scorer.score(batch)
    per_reward = {name: scores.components[name] for name in scorer.weights}
    return scores.totals, per_reward, [value == 1.0 for value in scores.accuracy]
