"""Rewards: the registry's scorers, score()'s weighting, and a failing reward's error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.data.rewards import (
    REWARDS,
    RewardError,
    exact_match_reward,
    format_reward,
    register_reward,
)
from rlflow.data.sample import Sample
from rlflow.data.scoring import score
from rlflow.errors import RlflowError

BASE_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "base.yaml"


def row(answer: str, id: str = "row-0") -> Sample:
    return Sample(id=id, media="text", question="How many?", answer=answer)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>3</answer>", 1.0),
        ("I count them. <answer> 3 </answer>", 1.0),
        ("<ANSWER>3</ANSWER>", 1.0),
        ("<answer>\n3\n</answer>", 1.0),
        ("3", 0.0),
        ("<answer>3", 0.0),
        ("<answer>1</answer><answer>3</answer>", 0.0),  # two answers: not the asked-for form
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(completion, "3") == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("<answer>3</answer>", "3", 1.0),
        ("<answer> 3 </answer>", "3", 1.0),
        ("<answer>3</answer>", " 3 ", 1.0),
        ("<answer>3.0</answer>", "3", 1.0),
        ("<answer>+3</answer>", "3", 1.0),
        ("<answer>4</answer>", "3", 0.0),
        ("<answer>-3</answer>", "3", 0.0),  # alnum-only matching would call these equal
        ("<answer>3.0</answer>", "30", 0.0),
        ("<answer>3 cubes</answer>", "3", 0.0),
        ("<answer></answer>", "3", 0.0),
        ("3", "3", 0.0),  # no tags, no credit
        ("<answer>Yes.</answer>", "yes", 1.0),
        ("<answer>!</answer>", "?", 0.0),  # nothing left after normalising is never a match
        (
            "<answer>1</answer> on second thought <answer>3</answer>",
            "3",
            1.0,
        ),  # the last one counts
        ("<answer>3</answer> on second thought <answer>1</answer>", "3", 0.0),
    ],
)
def test_exact_match_reward(completion, answer, expected):
    assert exact_match_reward(completion, answer) == expected


def test_score_weights_are_renormalised():
    completions = [
        "<answer>3</answer>",
        "<answer>4</answer>",
        "3",
        "<answer>1</answer><answer>3</answer>",
    ]
    samples = [row("3", f"r{i}") for i in range(4)]
    totals, per_reward, correct = score(completions, samples, {"format": 1.0, "exact_match": 4.0})
    assert per_reward == {"format": [1.0, 1.0, 0.0, 0.0], "exact_match": [1.0, 0.0, 0.0, 1.0]}
    assert totals == pytest.approx([1.0, 0.2, 0.0, 0.8])
    assert correct == [True, False, False, True]


def test_correct_is_exact_match_even_when_it_is_not_weighted():
    totals, per_reward, correct = score(
        ["<answer>3</answer>", "<answer>2</answer>"], [row("3"), row("3")], {"format": 0.5}
    )
    assert totals == [1.0, 1.0]
    assert list(per_reward) == ["format"]
    assert correct == [True, False]


@pytest.mark.parametrize(
    "weights, message",
    [
        ({"exact_mach": 1.0}, "`rewards.exact_mach` is not a known reward"),
        ({"format": -1.0, "exact_match": 2.0}, "must be a finite number, not negative"),
        ({"format": 0.0}, "add up to 0"),
    ],
)
def test_bad_weights_are_errors(weights, message):
    with pytest.raises(RlflowError, match=message):
        score(["<answer>3</answer>"], [row("3")], weights)


@pytest.fixture
def flaky_reward():
    """A registered reward that fails on answer "boom" (removed again after the test)."""

    @register_reward("test_flaky")
    def flaky(completion: str, answer: str) -> float:
        if answer == "boom":
            raise ZeroDivisionError("division by zero in my parser")
        return 0.5

    yield "test_flaky"
    del REWARDS["test_flaky"]


def test_a_raising_reward_names_the_reward_the_row_and_the_cause(flaky_reward):
    long_completion = "<answer>7</answer>" + "x" * 1000
    samples = [row("3", "clevr/1/0"), row("boom", "clevr/1/1")]
    with pytest.raises(RewardError) as caught:
        score(["<answer>3</answer>", long_completion], samples, {flaky_reward: 1.0, "format": 1.0})
    error = caught.value
    assert isinstance(error, RlflowError)
    assert (error.reward, error.sample_id) == ("test_flaky", "clevr/1/1")
    assert isinstance(error.__cause__, ZeroDivisionError)
    text = str(error)
    assert "reward `test_flaky` raised ZeroDivisionError: division by zero in my parser" in text
    assert "on row clevr/1/1" in text
    assert "<answer>7</answer>" in text and "characters) ..." in text
    assert len(text) < 800  # the completion is shortened, not pasted whole


@pytest.mark.parametrize("value", [1.5, -0.1, float("nan"), "1", None])
def test_a_reward_outside_zero_one_is_an_error(value):
    @register_reward("test_bad_value")
    def bad_value(completion: str, answer: str):
        return value

    try:
        with pytest.raises(RewardError, match="reward `test_bad_value` returned"):
            score(["<answer>3</answer>"], [row("3")], {"test_bad_value": 1.0})
    finally:
        del REWARDS["test_bad_value"]


def test_rewards_import_without_torch_or_pil():
    code = (
        "import sys, rlflow.data.rewards as r; "
        "import rlflow.data.scoring, rlflow.data.reward_pool, rlflow.data.user_rewards; "
        "from rlflow.data import REWARDS, score; "
        "from rlflow.rules import load_checked; "
        f"load_checked({str(BASE_RECIPE)!r}); "
        "assert r.REWARDS is REWARDS; "
        "heavy = [m for m in ('torch', 'PIL', 'megatron', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
