"""The async protocol's rules, in-process (rlflow/train/generation_role/remote.py): which weights generate which
batch, when the weights move, and the trainer's tripwire for rollouts off that schedule. The
runs that follow the protocol end to end: test_train_async.py."""

from __future__ import annotations

import pytest

from rlflow.errors import RlflowError
from rlflow.recipe.load import load_recipe
from rlflow.train.collect import RolloutContext
from rlflow.train.generation_role.remote import RemoteRollouts, RolloutBatch, Schedule
from tests.train.test_train_runs import RECIPE

ONE_STEP_OFF = [
    "generation.placement=separate",
    "generation.gpus_per_node=1",
    "async_grpo.max_staleness=1",
    "grpo.max_num_steps=4",
]


@pytest.mark.parametrize(
    "staleness, versions, synced",
    [
        (0, [0, 1, 2, 3], [True, True, True, False]),
        (1, [0, 0, 1, 2], [True, True, False, False]),
        (2, [0, 0, 0, 1], [True, False, False, False]),
    ],
    ids=["synchronous", "one-step-off", "two-steps"],
)
def test_the_schedule_gives_each_batch_weights_at_most_max_staleness_old(
    staleness, versions, synced
):
    schedule = Schedule(staleness, start=0, last=4)
    assert [schedule.version_for(batch) for batch in (1, 2, 3, 4)] == versions
    # the weights of a step move only if a later batch is generated with them
    assert [schedule.sync_after(step) for step in (1, 2, 3, 4)] == synced
    # a resumed run starts from its checkpoint's weights: fresher, never older
    assert Schedule(staleness, start=2, last=4).version_for(3) == 2


@pytest.mark.parametrize(
    "batch_step, version", [(4, 1), (3, 2), (3, 0)], ids=["wrong-batch", "too-new", "too-stale"]
)
def test_the_trainer_refuses_rollouts_off_the_schedule(batch_step, version):
    """Step 3 of a one-step-off run wants batch 3 from the weights of version 1; a batch of
    another step, or from newer or staler weights, stops the run naming both versions."""
    recipe = load_recipe(RECIPE, ONE_STEP_OFF).recipe
    # the check reads only the recipe: no engine, data or rewards behind the context
    context = RolloutContext(recipe, None, None, None, None, None, None)
    remote = RemoteRollouts(link=None, context=context)
    remote.schedule = Schedule(1, start=0, last=4)
    remote._check(RolloutBatch(step=3, weight_version=1, groups=[], sums={}, sampler_state={}), 3)
    batch = RolloutBatch(
        step=batch_step, weight_version=version, groups=[], sums={}, sampler_state={}
    )
    with pytest.raises(RlflowError) as error:
        remote._check(batch, 3)
    (diagnostic,) = error.value.diagnostics
    assert diagnostic.code == "async.stale-rollouts"
    assert f"rollouts of batch {batch_step} generated with weights of version {version}" in (
        diagnostic.message
    )
    assert "async_grpo.max_staleness is 1, the schedule says version 1" in diagnostic.message


def trajectory(turn_versions_: list[int]):
    """Two tokens per model turn (version given), one environment token after each but the
    last (loss mask 0, the turn's version)."""
    from rlflow.generation.base import Completion

    mask, versions = [], []
    for k, v in enumerate(turn_versions_):
        mask += [1, 1] + ([0] if k < len(turn_versions_) - 1 else [])
        versions += [v] * (3 if k < len(turn_versions_) - 1 else 2)
    n = len(mask)
    return Completion(list(range(n)), [-0.5] * n, "stop", loss_mask=mask, token_versions=versions)


@pytest.mark.parametrize("on_stale_turn", ["stop", "drop"])
def test_every_model_turn_is_checked_against_the_staleness_bound(on_stale_turn):
    """Step 4 of a one-step-off run trains weights of version 3 on a batch of version 2: a
    trajectory whose first turn came from version 1 (two steps old) stops the run naming it,
    or, with on_stale_turn: drop, trains without that turn's tokens (counted)."""
    from rlflow.model.media import Media, Prompt

    recipe = load_recipe(RECIPE, [*ONE_STEP_OFF, f"async_grpo.on_stale_turn={on_stale_turn}"])
    context = RolloutContext(recipe.recipe, None, None, None, None, None, None)
    remote = RemoteRollouts(link=None, context=context)
    remote.schedule = Schedule(1, start=0, last=4)
    prompt = Prompt("row7", "", (1, 2), Media())
    fresh, stale = trajectory([2, 2]), trajectory([1, 2, 3])
    batch = RolloutBatch(4, 2, [(prompt, [fresh, stale], [0.5, -0.5])], {}, {})
    if on_stale_turn == "stop":
        with pytest.raises(RlflowError) as error:
            remote._check_turns(batch, 4)
        (diagnostic,) = error.value.diagnostics
        assert diagnostic.code == "async.stale-turn"
        assert "model turn 0 of a trajectory of row `row7`" in diagnostic.message
        assert "version 1; the trainer accepts versions 2 to 3" in diagnostic.message
        return
    [(_, [kept_fresh, kept_stale], _)] = remote._check_turns(batch, 4).groups
    assert kept_fresh == fresh  # every turn within the bound: unchanged
    assert kept_stale.loss_mask == [0, 0, 0, 1, 1, 0, 1, 1]  # turn 0 out of the loss, in context
    assert kept_stale.token_ids == stale.token_ids
    assert remote.turn_metrics == {
        "async/stale_turns": 1.0, "async/stale_tokens": 2.0, "async/turn_staleness_max": 1.0
    }  # fmt: skip
    # a turn newer than the trainer's weights is an error either way
    with pytest.raises(RlflowError) as error:
        remote._check_turns(RolloutBatch(4, 2, [(prompt, [trajectory([1, 4])], [0.0])], {}, {}), 4)
    assert "model turn 1 of a trajectory of row `row7` was generated with weights of version 4" in (
        error.value.diagnostics[0].message
    )


def test_on_stale_turn_is_refused_without_generation_ranks_of_their_own():
    from rlflow.rules import load_checked
    from rlflow.rules.allocation import check_allocation

    with pytest.raises(RlflowError) as error:
        check_allocation(load_checked(RECIPE, ["async_grpo.on_stale_turn=drop"]), 1)
    text = "\n".join(d.render() for d in error.value.diagnostics)
    assert "`async_grpo.on_stale_turn` is set, but generation.placement is colocated" in text
