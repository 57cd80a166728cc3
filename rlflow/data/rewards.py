"""Rewards: the batch contract, the built-in rewards and their registry.

A reward is a function of one `RewardBatch` (a few rollouts, column by column) that returns
one float per rollout, or a dict of named components (each a list of one float per rollout;
the reward's value is their sum, and each is logged as its own metric). Recipes name rewards
with a weight: a registered name (`exact_match`) or an import path (`my_pkg.rewards:fn`)::

    rewards: {format: 0.2, exact_match: 0.8, my_pkg.rewards:brevity: 0.5}

`rlflow.data.scoring.Scorer` applies the weights, renormalised to sum to 1. Built-in rewards
are per-row functions (completion, reference answer) -> [0, 1], registered with
`@register_reward("name")`. This module must stay importable without torch or PIL: recipe
checks on login nodes and reward worker processes import it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from typing import TYPE_CHECKING, Any

from rlflow.data.prompts import ANSWER_RE
from rlflow.errors import EXIT_FINDINGS, Diagnostic, RlflowError
from rlflow.frozen import frozen

if TYPE_CHECKING:
    from rlflow.data.sample import Sample

RowRewardFn = Callable[[str, str], float]
RewardFn = RowRewardFn  # the registry's per-row form (kept for code that imports this name)
RewardValues = Sequence[float] | Mapping[str, Sequence[float]]
BatchRewardFn = Callable[["RewardBatch"], RewardValues]
REWARDS: dict[str, RowRewardFn] = {}

NUMBER_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)")
SHOWN_CHARS = 160  # how much of a completion an error message quotes


@frozen
class RewardBatch:
    """What a reward sees: rollouts column by column, all lists of the same length.

    A batch is some of a step's rollouts (the G generations of a prompt are usually, but not
    always, in one batch); return exactly one value per rollout, in order.
    """

    prompts: list[str]  # the user turn's text as the model saw it (template + suffix), no markup
    completions: list[str]  # the generated text, special tokens removed
    completion_tokens: list[int]  # generated tokens, including the stop token if one ended it
    finish_reasons: list[str]  # "stop" (EOS) or "length" (hit generation.max_new_tokens)
    answers: list[str]  # the reference answer of the row
    media: list[str]  # "image" | "video" | "text"
    fields: list[dict[str, Any]] = field(default_factory=list)  # extra JSONL columns, per rollout
    sample_ids: list[str] = field(default_factory=list)  # "file.jsonl:12", or the row's `id`

    def __len__(self) -> int:
        return len(self.completions)

    def rows(self, index: slice | Sequence[int]) -> RewardBatch:
        """The sub-batch of the given rollouts (same columns)."""
        pick = list(range(len(self)))[index] if isinstance(index, slice) else list(index)
        return RewardBatch(
            **{name: [getattr(self, name)[i] for i in pick] for name in _COLUMNS},
        )

    def row(self, i: int) -> dict[str, Any]:
        """Rollout i as a dict (error messages show it)."""
        return {name: getattr(self, name)[i] for name in _COLUMNS}

    @staticmethod
    def build(
        prompts: Sequence[str],
        completions: Sequence[str],
        completion_tokens: Sequence[int],
        finish_reasons: Sequence[str],
        samples: Sequence[Sample],
    ) -> RewardBatch:
        """A batch for rollouts of `samples[i]` (repeat each row once per generation)."""
        return RewardBatch(
            prompts=list(prompts),
            completions=list(completions),
            completion_tokens=[int(n) for n in completion_tokens],
            finish_reasons=list(finish_reasons),
            answers=[s.answer for s in samples],
            media=[s.media for s in samples],
            fields=[dict(s.fields) for s in samples],
            sample_ids=[s.id for s in samples],
        )


_COLUMNS = (
    "prompts",
    "completions",
    "completion_tokens",
    "finish_reasons",
    "answers",
    "media",
    "fields",
    "sample_ids",
)


def register_reward(name: str) -> Callable[[RowRewardFn], RowRewardFn]:
    def add(fn: RowRewardFn) -> RowRewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        REWARDS[name] = fn
        return fn

    return add


def is_import_path(name: str) -> bool:
    """`package.module:function` names user code; anything else is a registered name."""
    return ":" in name


KeyPath = tuple[str, ...]


def weight_problems(weights: Mapping[str, float]) -> list[tuple[KeyPath, Diagnostic]]:
    """The rules for a recipe's `rewards:` weights, stated once: (the key to blame, the problem).

    `check_recipe` points each at the recipe's line; `Scorer` raises them (for weights that
    never went through a recipe). Import paths are judged elsewhere: from source by the dry run
    (rlflow.data.user_rewards), by a real import when scoring starts.
    """
    problems: list[tuple[KeyPath, Diagnostic]] = []
    for name, weight in weights.items():
        if not is_import_path(name) and name not in REWARDS:
            close = [n for n in REWARDS if n.startswith(name[:3])]
            problems.append(
                (
                    ("rewards", name),
                    Diagnostic(
                        "recipe.unknown-reward",
                        f"`rewards.{name}` is not a known reward",
                        help=(f"did you mean `{close[0]}`? " if close else "")
                        + "known rewards: "
                        + ", ".join(sorted(REWARDS))
                        + "; or a function of your own as package.module:function",
                    ),
                )
            )
        elif isinstance(weight, bool) or not isinstance(weight, int | float):
            problems.append(
                (
                    ("rewards", name),
                    Diagnostic(
                        "recipe.range", f"`rewards.{name}` weight {weight!r} must be a number"
                    ),
                )
            )
        elif not math.isfinite(weight) or weight < 0:
            problems.append(
                (
                    ("rewards", name),
                    Diagnostic(
                        "recipe.range",
                        f"`rewards.{name}` weight {weight!r} must be a finite number, not negative",
                        help="0 turns a reward off",
                    ),
                )
            )
    total = sum(weights.values()) if not problems else 0.0
    if not problems and not math.isfinite(total):
        problems.append(
            (
                ("rewards",),
                Diagnostic(
                    "recipe.range",
                    f"the `rewards` weights ({' + '.join(f'{w:g}' for w in weights.values())}) "
                    f"add up to {total:g}: each reward's share is its weight over the total, "
                    "which would be 0 for every reward",
                    help="weights are relative: scale them down, e.g. 0.2 and 0.8",
                ),
            )
        )
    if not problems and total <= 0:
        problems.append(
            (
                ("rewards",),
                Diagnostic(
                    "recipe.range",
                    "the reward weights add up to 0: `rewards` needs at least one reward with a "
                    "positive weight",
                    help="give at least one reward a positive weight",
                ),
            )
        )
    return problems


def accuracy_problem(accuracy: str) -> Diagnostic | None:
    """`scoring.accuracy` must name a reward, or reward/component (registered names here)."""
    reward = accuracy.split("/", 1)[0]
    if is_import_path(reward) or reward in REWARDS:
        return None
    return Diagnostic(
        "recipe.unknown-reward",
        f"`scoring.accuracy` names `{reward}`, which is not a known reward",
        help="name a reward (known: " + ", ".join(sorted(REWARDS)) + "), an import path "
        "package.module:function, or reward/component for a reward that returns a dict",
    )


def extract_answer(completion: str) -> str | None:
    """The text of the last <answer>...</answer> block, stripped; None if there is none."""
    matches = ANSWER_RE.findall(completion)
    return matches[-1].strip() if matches else None


def answers_match(got: str, reference: str) -> bool:
    """Numbers compare by value ("3", " 3 ", "3.0", "+3"); other text by its lower-case letters
    and digits ("Yes." == "yes"). A numeric reference never matches non-numeric text, so "-3"
    does not pass for "3" and "3.0" does not pass for "30"."""
    got, reference = got.strip(), reference.strip()
    if NUMBER_RE.fullmatch(reference):
        return NUMBER_RE.fullmatch(got) is not None and float(got) == float(reference)
    return _normalize(got) != "" and _normalize(got) == _normalize(reference)


def _normalize(text: str) -> str:
    return re.sub(r"[^0-9a-z]", "", text.lower())


@register_reward("format")
def format_reward(completion: str, answer: str) -> float:
    """1 when the completion holds exactly one well-formed <answer>...</answer> block."""
    return 1.0 if len(ANSWER_RE.findall(completion)) == 1 else 0.0


@register_reward("exact_match")
def exact_match_reward(completion: str, answer: str) -> float:
    """1 when the last <answer> block's content equals the reference (see `answers_match`)."""
    got = extract_answer(completion)
    return 1.0 if got is not None and answers_match(got, answer) else 0.0


class RewardError(RlflowError):
    """A reward raised, returned a bad value, or timed out: the run stops, naming the reward
    and showing the rollout it failed on."""

    def __init__(
        self,
        reward: str,
        sample_id: str,
        completion: str,
        message: str,
        help: str,
        notes: Sequence[str] = (),
    ):
        self.reward, self.sample_id, self.completion = reward, sample_id, completion
        super().__init__(
            Diagnostic(
                "reward.failed",
                f"reward `{reward}` {message} on row {sample_id}",
                notes=(f"completion: {shorten(completion)}", *notes),
                help=help,
            ),
            exit_code=EXIT_FINDINGS,
        )


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """repr() of text, its middle elided past `limit` characters (error messages stay short)."""
    if len(text) <= limit:
        return repr(text)
    half = limit // 2
    return f"{text[:half]!r} ... ({len(text) - 2 * half} characters) ... {text[-half:]!r}"
