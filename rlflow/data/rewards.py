"""Rewards: pure functions (completion, reference answer) -> score in [0, 1].

Recipes weight them by name (`rewards: {format: 0.2, exact_match: 0.8}`). Add one with
`@register_reward("name")`. This module must stay importable without torch: recipe validation
on login nodes reads REWARDS to check the names.
"""

from __future__ import annotations

import re
from collections.abc import Callable

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


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


def _normalize(text: str) -> str:
    return re.sub(r"[^0-9a-z]", "", text.lower())


@register_reward("format")
def format_reward(completion: str, answer: str) -> float:
    """1 when the completion holds exactly one well-formed <answer>...</answer> block."""
    return 1.0 if len(ANSWER_RE.findall(completion)) == 1 else 0.0


@register_reward("exact_match")
def exact_match_reward(completion: str, answer: str) -> float:
    """1 when the <answer> content equals the reference, ignoring case, spaces and punctuation."""
    got = extract_answer(completion)
    return 1.0 if got is not None and _normalize(got) == _normalize(answer) and got != "" else 0.0
