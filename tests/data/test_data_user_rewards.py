"""Rewards from user code: the static import-path check (no user code runs), the Scorer's
weighting and components, and failures (raise, NaN, bad shape, timeout) in this process and
in the worker pool. User modules are real files in a tmp directory on the search path."""

from __future__ import annotations

import math
import sys
import time

import pytest

from rlflow.data.rewards import RewardBatch, RewardError
from rlflow.data.scoring import Scorer
from rlflow.data.user_rewards import check_import_path
from rlflow.errors import RlflowError

MODULE = """
import math, time
from rlflow.data.rewards import RewardBatch


def length(batch: RewardBatch) -> list[float]:
    return [min(len(c), 10) / 10 for c in batch.completions]


def parts(batch):
    return {"hit": [1.0 if a in c else 0.0 for c, a in zip(batch.completions, batch.answers)],
            "level": [float(f["level"]) for f in batch.fields]}


def picky(batch):
    out = []
    for c, f in zip(batch.completions, batch.fields):
        if f["level"] == 3:
            raise KeyError("no rule for level 3")
        out.append(0.5)
    return out


def nan_on_empty(batch):
    return [math.nan if not c else 1.0 for c in batch.completions]


def short(batch):
    return [1.0]


def sleepy(batch):
    time.sleep(30)
    return [0.0] * len(batch)


def pairs(batch):
    import numpy
    return numpy.ones((len(batch), 2))


class Stubborn:
    def __float__(self):
        raise ArithmeticError("no float for you")


def stubborn(batch):
    return [0.5, Stubborn(), 0.5][: len(batch)]
"""


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "my_rewards.py").write_text(MODULE)
    package = tmp_path / "team" / "scoring"
    package.mkdir(parents=True)
    # A package whose __init__ would fail (or pull in torch) if the check executed it.
    (tmp_path / "team" / "__init__.py").write_text("raise RuntimeError('executed!')\n")
    (package / "__init__.py").write_text("import torch_that_does_not_exist\n")
    (package / "math_rewards.py").write_text(
        "import torch_that_does_not_exist\n\ndef boxed(batch):\n    return []\n"
    )
    (tmp_path / "starry.py").write_text("from os.path import *\n")
    (tmp_path / "broken.py").write_text("def f(batch):\n    return [\n")
    (tmp_path / "two_args.py").write_text("def score(completion, answer):\n    return 1.0\n")
    (tmp_path / "lambdas.py").write_text(
        "score = lambda completion, answer: 1.0\nok = lambda b: []\n"
    )
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] in ("my_rewards", "team")]:
        del sys.modules[name]


def batch(completions, answers=None, levels=None) -> RewardBatch:
    n = len(completions)
    return RewardBatch(
        prompts=[f"question {i}?" for i in range(n)],
        completions=list(completions),
        completion_tokens=[len(c) for c in completions],
        finish_reasons=["stop"] * n,
        answers=list(answers or ["3"] * n),
        media=["text"] * n,
        fields=[{"level": lv} for lv in (levels or [1] * n)],
        sample_ids=[f"rows.jsonl:{i + 1}" for i in range(n)],
    )


# ---------------------------------------------------------------- the dry run's check


def test_existing_functions_pass_without_running_user_code(user_dir):
    assert check_import_path("my_rewards:length", [str(user_dir)]) is None
    assert check_import_path("team.scoring.math_rewards:boxed", [str(user_dir)]) is None
    assert check_import_path("starry:anything", [str(user_dir)]) is None  # star import: unknowable
    assert check_import_path("lambdas:ok", [str(user_dir)]) is None
    assert "team" not in sys.modules and "my_rewards" not in sys.modules


@pytest.mark.parametrize(
    "spec, problem, help",
    [
        ("my_rewards:lenght", "module `my_rewards` (", "did you mean `my_rewards:length`?"),
        ("my_rewrds:length", "no module `my_rewrds` is importable from", "add that directory"),
        ("team.scoring.nope:f", "no module `team.scoring.nope`", "PYTHONPATH"),
        ("broken:f", "has a syntax error", "fix the module"),
        ("two_args:score", "takes (completion, answer)", "def score(batch: RewardBatch)"),
        ("lambdas:score", "takes (completion, answer)", "; it is a lambda now"),
        ("my rewards:x", "is not an import path", "package.module:function"),
    ],
)
def test_problems_are_named_with_a_fix(user_dir, spec, problem, help):
    found = check_import_path(spec, [str(user_dir)])
    assert found is not None and problem in found[0] and help in found[1], found


# ---------------------------------------------------------------- scoring


def scorer(user_dir, weights, accuracy="exact_match", workers=0, timeout=20.0) -> Scorer:
    return Scorer(weights, accuracy, workers, timeout, [str(user_dir)])


def test_weights_components_and_accuracy(user_dir):
    rows = batch(["<answer>3</answer>", "three", ""], levels=[1, 2, 1])
    with scorer(user_dir, {"my_rewards:length": 1.0, "my_rewards:parts": 1.0, "format": 0},
                accuracy="my_rewards:parts/hit") as s:  # fmt: skip
        scores = s.score(rows)
    # length: 1.0, 0.5, 0.0; parts = hit + level: 2.0, 2.0, 1.0; equal shares (format is off)
    assert scores.components["my_rewards:length"] == [1.0, 0.5, 0.0]
    assert scores.components["my_rewards:parts/hit"] == [1.0, 0.0, 0.0]
    assert scores.components["my_rewards:parts/level"] == [1.0, 2.0, 1.0]
    assert scores.components["my_rewards:parts"] == [2.0, 2.0, 1.0]
    assert scores.totals == pytest.approx([1.5, 1.25, 0.5])
    assert scores.accuracy == [1.0, 0.0, 0.0]
    assert "format" not in scores.components  # weight 0: not run


def test_the_pool_gives_the_same_scores_as_in_process(user_dir):
    rows = batch([f"<answer>{i}</answer>" * (i % 3) for i in range(7)], levels=list(range(7)))
    weights = {"my_rewards:length": 0.5, "my_rewards:parts": 0.5, "exact_match": 1.0}
    with scorer(user_dir, weights) as here, scorer(user_dir, weights, workers=2) as pooled:
        assert pooled.pool is not None
        assert pooled.score(rows) == here.score(rows)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_raising_reward_names_itself_and_shows_the_row_it_failed_on(user_dir, workers):
    rows = batch(["a", "b", "c", "d"], answers=["1", "2", "3", "4"], levels=[1, 2, 3, 1])
    with scorer(user_dir, {"my_rewards:picky": 1.0}, workers=workers) as s:
        with pytest.raises(RewardError) as caught:
            s.score(rows)
    error = caught.value
    assert (error.reward, error.sample_id) == ("my_rewards:picky", "rows.jsonl:3")
    text = str(error)
    assert (
        "reward `my_rewards:picky` raised KeyError: 'no rule for level 3' on row rows.jsonl:3"
        in text
    )
    assert "prompt: 'question 2?'" in text and "answer: '3'" in text and "'level': 3" in text
    assert 'raise KeyError("no rule for level 3")' in text  # the user's traceback, last lines
    assert error.exit_code == 1


@pytest.mark.parametrize("workers", [0, 1])
def test_nan_and_wrong_shapes_stop_the_run(user_dir, workers):
    with scorer(user_dir, {"my_rewards:nan_on_empty": 1.0}, workers=workers) as s:
        with pytest.raises(RewardError, match=r"returned nan on row rows.jsonl:2"):
            s.score(batch(["x", "", "y"]))
    with scorer(user_dir, {"my_rewards:short": 1.0}, workers=workers) as s:
        with pytest.raises(RewardError, match="returned 1 values for 3 rollouts"):
            s.score(batch(["x", "y", "z"]))


def test_a_reward_past_its_timeout_stops_and_leaves_no_worker(user_dir):
    s = scorer(user_dir, {"my_rewards:sleepy": 1.0}, workers=1, timeout=1.0)
    workers = [w.process for w in s.pool._workers]
    start = time.monotonic()
    with pytest.raises(RewardError) as caught:
        s.score(batch(["x", "y"]))
    assert time.monotonic() - start < 10
    assert "did not return within scoring.timeout_s=1 s" in str(caught.value)
    assert "raise scoring.timeout_s" in caught.value.diagnostics[0].help
    assert all(not w.is_alive() for w in workers)


def test_import_failures_and_unknown_names(user_dir):
    with scorer(user_dir, {"my_rewards:gone": 1.0}) as s:
        with pytest.raises(RewardError, match="cannot be imported: AttributeError"):
            s.score(batch(["x"]))
    with pytest.raises(RlflowError, match="`rewards.exact_mach` is not a known reward"):
        scorer(user_dir, {"exact_mach": 1.0})
    with pytest.raises(RlflowError, match="`scoring.accuracy` names `acc`, which is not a known"):
        scorer(user_dir, {"format": 1.0}, accuracy="acc")
    with pytest.raises(RlflowError, match="weight nan must be a finite number"):
        scorer(user_dir, {"format": math.nan})


def test_a_missing_accuracy_component_is_named(user_dir):
    with scorer(user_dir, {"my_rewards:parts": 1.0}, accuracy="my_rewards:parts/miss") as s:
        with pytest.raises(RlflowError, match="returned the components my_rewards:parts/hit"):
            s.score(batch(["x"]))


def test_the_contract_is_typed():
    """The contract's types as a user sees them (docs/data-and-rewards.md "Rewards from your code")."""
    import typing

    hints = typing.get_type_hints(RewardBatch)
    assert hints["completions"] == list[str] and hints["completion_tokens"] == list[int]
    assert hints["fields"] == list[dict[str, typing.Any]]


@pytest.mark.parametrize("workers", [0, 1])
def test_arrays_of_pairs_and_values_that_refuse_float_are_named(user_dir, workers):
    with scorer(user_dir, {"my_rewards:pairs": 1.0}, workers=workers) as s:
        with pytest.raises(RewardError, match=r"returned an array of shape \(3, 2\), not a list"):
            s.score(batch(["x", "y", "z"]))
    with scorer(user_dir, {"my_rewards:stubborn": 1.0}, workers=workers) as s:
        with pytest.raises(RewardError) as caught:
            s.score(batch(["x", "y", "z"]))
    assert caught.value.diagnostics[0].message == (
        "reward `my_rewards:stubborn` returned a Stubborn whose float() raised ArithmeticError: "
        "no float for you on row rows.jsonl:2"
    )
