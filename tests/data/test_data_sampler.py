"""PromptSampler: epochs are permutations, and a resumed sampler continues batch for batch."""

from __future__ import annotations

import copy
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.data import PromptSampler
from rlflow.errors import RlflowError


def take(sampler, n: int) -> list[list[int]]:
    return list(itertools.islice(sampler, n))


def test_each_epoch_visits_every_row_once_in_a_new_order():
    batches = take(PromptSampler(dataset_len=12, batch_size=4, seed=0), 9)
    epochs = [sum(batches[i : i + 3], []) for i in (0, 3, 6)]
    assert all(sorted(epoch) == list(range(12)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 3


def test_a_batch_runs_on_into_the_next_epoch():
    sampler = PromptSampler(dataset_len=5, batch_size=3, seed=0)
    stream = sum(take(sampler, 10), [])
    assert [sorted(stream[i : i + 5]) for i in range(0, 30, 5)] == [list(range(5))] * 6
    assert sampler.epoch == 5  # the sixth epoch (from 0) is used up; the seventh starts on demand


def test_seed_decides_the_order():
    def first(seed):
        return take(PromptSampler(100, 10, seed), 3)

    assert first(1) == first(1)
    assert first(1) != first(2)


@settings(max_examples=40, deadline=None)
@given(
    dataset_len=st.integers(1, 40),
    batch_size=st.integers(1, 16),
    seed=st.integers(0, 2**32),
    steps_before=st.integers(0, 12),
)
def test_resume_continues_with_the_same_batches(dataset_len, batch_size, seed, steps_before):
    uninterrupted = PromptSampler(dataset_len, batch_size, seed)
    expected = take(uninterrupted, steps_before + 8)[steps_before:]

    first_run = PromptSampler(dataset_len, batch_size, seed)
    take(first_run, steps_before)
    saved = copy.deepcopy(first_run.state_dict())  # what a checkpoint would store
    resumed = PromptSampler(dataset_len, batch_size, seed)
    resumed.load_state_dict(saved)
    assert take(resumed, 8) == expected


def test_state_dict_is_plain_data():
    sampler = PromptSampler(10, 3, seed=5)
    take(sampler, 4)
    assert sampler.state_dict() == {"dataset_len": 10, "seed": 5, "epoch": 1, "position": 2}


@pytest.mark.parametrize("key, value", [("dataset_len", 11), ("seed", 6)])
def test_resume_with_other_data_is_an_error(key, value):
    state = PromptSampler(10, 3, seed=5).state_dict() | {key: value}
    with pytest.raises(RlflowError, match=f"saved with {key}={value}, but this run has"):
        PromptSampler(10, 3, seed=5).load_state_dict(state)
