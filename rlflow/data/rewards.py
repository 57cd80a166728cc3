"""Rewards: pure functions (completion, reference answer) -> score in [0, 1].

Recipes weight them by name (`rewards: {format: 0.2, exact_match: 0.8}`); `score` applies the
weights, renormalised to sum to 1, to a batch of rollouts. Add one with
`@register_reward("name")`. This module must stay importable without torch or PIL: recipe
validation on login nodes reads REWARDS to check the names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from rlflow.errors import EXIT_FINDINGS, Diagnostic, RlflowError

if TYPE_CHECKING:
    from rlflow.data.sample import Sample

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
NUMBER_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)")
SHOWN_CHARS = 160  # how much of a completion an error message quotes


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def add(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        REWARDS[name] = fn
        return fn

    return add


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


# --- scoring a batch --------------------------------------------------------------------------


class RewardError(RlflowError):
    """A reward function raised or returned a value outside [0, 1] on one row."""

    def __init__(self, reward: str, sample_id: str, completion: str, message: str, help: str):
        self.reward, self.sample_id, self.completion = reward, sample_id, completion
        super().__init__(
            Diagnostic(
                "reward.failed",
                f"reward `{reward}` {message} on row {sample_id}",
                notes=(f"completion: {shorten(completion)}",),
                help=help,
            ),
            exit_code=EXIT_FINDINGS,
        )


def score(
    completions: Sequence[str], samples: Sequence[Sample], weights: Mapping[str, float]
) -> tuple[list[float], dict[str, list[float]], list[bool]]:
    """Score rollouts: (weighted totals, each reward's scores, exact-match correctness).

    `samples[i]` is the prompt row `completions[i]` answered: repeat each row once per
    generation. Weights are renormalised to sum to 1, so totals stay in [0, 1].
    """
    assert len(completions) == len(samples), "one sample per completion"
    shares = normalized_weights(weights)
    per_reward = {
        name: [_run(name, c, s) for c, s in zip(completions, samples, strict=True)]
        for name in shares
    }
    totals = [
        sum(share * per_reward[name][row] for name, share in shares.items())
        for row in range(len(completions))
    ]
    exact = per_reward.get("exact_match") or [
        _run("exact_match", c, s) for c, s in zip(completions, samples, strict=True)
    ]
    return totals, per_reward, [value == 1.0 for value in exact]


def normalized_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Recipe weights -> shares summing to 1; unknown names and bad weights are errors."""
    problems = [
        Diagnostic(
            "recipe.unknown-reward",
            f"`rewards.{name}` is not a known reward",
            help="known rewards: " + ", ".join(sorted(REWARDS)),
        )
        for name in weights
        if name not in REWARDS
    ]
    problems += [
        Diagnostic("recipe.range", f"`rewards.{name}` weight {w} must not be negative")
        for name, w in weights.items()
        if w < 0
    ]
    total = sum(weights.values())
    if not problems and total <= 0:
        problems.append(
            Diagnostic(
                "recipe.range",
                "the reward weights add up to 0",
                help="give at least one reward a positive weight",
            )
        )
    if problems:
        raise RlflowError(problems)
    return {name: w / total for name, w in weights.items()}


def _run(name: str, completion: str, sample: Sample) -> float:
    try:
        value = REWARDS[name](completion, sample.answer)
    except Exception as exc:
        raise RewardError(
            name,
            sample.id,
            completion,
            f"raised {type(exc).__name__}: {exc}",
            help=f"fix the reward `{name}` (traceback above) or the row's "
            f"reference answer {sample.answer!r}",
        ) from exc
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise RewardError(
            name,
            sample.id,
            completion,
            f"returned {value!r}, not a number in [0, 1]",
            help=f"make `{name}` return a float between 0 and 1",
        )
    return float(value)


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """repr() of text, its middle elided past `limit` characters (error messages stay short)."""
    if len(text) <= limit:
        return repr(text)
    half = limit // 2
    return f"{text[:half]!r} ... ({len(text) - 2 * half} characters) ... {text[-half:]!r}"
