"""Partial rollouts (rlflow/train/partial.py): a budget cuts rows, they continue as re-prefilled
continuations with the same tokens uninterrupted greedy decoding gives, each token records its
weight version; stale rows start over; rows in flight survive a checkpoint; and one real
`rlflow train` run with partial rollouts on, stopped and resumed.

The real megatron engine on the tiny Qwen2.5-VL (fp32, its head scaled so greedy decoding has
no near-ties: tests/tiny.py), as tests/generation/test_generation_kv_cache.py uses it."""

from __future__ import annotations

import json

import pytest

from rlflow.generation.base import SamplingParams
from rlflow.train.metrics import read_metrics
from rlflow.train.partial import Group, PartialRollouts, Row, advance, drop_stale
from tests.tiny import megatron_generation, mixed_prompts
from tests.train.test_train_checkpoint_resume import _policy
from tests.train.test_train_runs import train

CAP = 24  # tokens a row may have
BUDGET = 5  # decode steps per call


@pytest.fixture(scope="module", name="greedy_run")
def greedy_run_fixture(tiny_policy, tiny_processor):
    """Rows (2 per prompt), the engine, a stop token some rows sample early, and the rows'
    uninterrupted greedy completions with that stop token."""
    rows = [p for p in mixed_prompts(tiny_processor) for _ in range(2)]
    engine = megatron_generation(tiny_policy, tiny_processor.tokenizer.pad_token_id)
    free = engine.generate(rows, SamplingParams(CAP, 0.0, 1.0, 0, 5, (-1,), True))
    firsts = [set(c.token_ids[:8]) for c in free]
    stop = next(t for s in firsts for t in s if 0 < sum(t in f for f in firsts) < len(rows))
    params = SamplingParams(CAP, 0.0, 1.0, 0, 5, (stop,), False)
    return rows, engine, params, engine.generate(rows, params)


def test_budget_cuts_rows_that_continue_to_the_uninterrupted_tokens(tiny_policy, greedy_run):
    rows, engine, params, whole = greedy_run
    states = [Row() for _ in rows]
    pending = list(zip(rows, states))
    calls = 0
    while pending:
        engine.refresh_weights(calls)  # each call's tokens carry its version
        advance(engine, pending, params, budget_steps=BUDGET, max_new_tokens=CAP,
                prompt_ids=tiny_policy.prompt_ids)  # fmt: skip
        if calls == 0:  # the budget cut every row that did not stop within it
            assert any(r.finish_reason is None and len(r.token_ids) == BUDGET for r in states)
        pending = [(p, r) for p, r in pending if r.finish_reason is None]
        calls += 1
    assert calls == -(-CAP // BUDGET)
    for row, ref in zip(states, whole, strict=True):
        assert row.token_ids == ref.token_ids
        assert row.finish_reason == ref.finish_reason
        assert row.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert row.versions == [i // BUDGET for i in range(len(row.token_ids))]
        assert row.completion().token_versions == row.versions


def test_a_pass_ends_at_its_finished_fraction(greedy_run):
    """stop_fraction: the pass ends at the first stop check (every 8 steps) where that share of
    rows finished; the rest end `budget` with the uninterrupted tokens so far."""
    rows, engine, params, whole = greedy_run
    stopped_by_8 = sum(len(c.token_ids) <= 8 and c.finish_reason == "stop" for c in whole)
    cut = engine.generate(rows, SamplingParams(
        CAP, 0.0, 1.0, 0, 5, params.stop_token_ids, False, stop_fraction=stopped_by_8 / len(rows)
    ))  # fmt: skip
    for c, ref in zip(cut, whole, strict=True):
        assert ref.token_ids[: len(c.token_ids)] == c.token_ids
        assert c.finish_reason == (ref.finish_reason if len(ref.token_ids) <= 8 else "budget")


def test_stale_rows_start_over_and_are_counted():
    fresh, old = Row([1, 2], [-0.1, -0.2], [3, 3]), Row([4, 5, 6], [-0.1] * 3, [1, 1, 2], "stop")
    groups = [Group(0, 1, [fresh, old, Row()])]
    assert drop_stale(groups, 4, 2) == (1, 3)  # old's first token is 3 updates old
    assert groups[0].rows == [fresh, Row(), Row()]
    assert drop_stale(groups, 4, 2) == (0, 0)


def test_rows_in_flight_survive_a_checkpoint(single_rank, tmp_path):
    from rlflow.train.checkpoint import Checkpointer

    source = PartialRollouts(context=None)
    source.groups = [
        Group(7, 2, [Row([1, 2], [-0.5, -0.25], [1, 2], "stop"), Row([3], [-1.0], [2])]),
        Group(9, 3, [Row(), Row([4, 5, 6], [-0.125, -2.0, -0.75], [2, 2, 2])]),
    ]
    checkpointer = Checkpointer(tmp_path, keep_last=2)
    chunks, optimizer = _policy(0)
    checkpointer.save(3, chunks, optimizer, {"sampler": {}}, source.state_dict())
    latest = checkpointer.latest()
    resumed = PartialRollouts(context=None)
    assert resumed.load_state_dict(checkpointer.rank_state(latest)) == 3
    assert resumed.groups == source.groups
    assert PartialRollouts(context=None).state_dict() == {"groups": []}


PARTIAL = [
    "generation.partial_rollouts.enabled=true",
    "generation.partial_rollouts.budget_steps=2",
    "generation.partial_rollouts.max_staleness_steps=3",
    "warm_start.num_steps=0",  # (every row runs to the cap: the nearest group alone finishes)
    "grpo.val_period=0",
    "grpo.val_at_start=false",
    "grpo.val_at_end=false",
]


def test_train_with_partial_rollouts_stops_and_resumes_with_its_rows(tmp_path):
    first = train(tmp_path, *PARTIAL, "grpo.max_num_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    state = json.loads((tmp_path / "checkpoints/step_000002/rollouts_rank0.json").read_text())
    unfinished = [r for g in state["groups"] for r in g["rows"] if r["finish_reason"] is None]
    assert unfinished and all(1 <= len(r["token_ids"]) < 8 for r in unfinished)
    assert all(set(r["versions"]) <= {0, 1} for g in state["groups"] for r in g["rows"])
    second = train(tmp_path, *PARTIAL, "grpo.max_num_steps=3")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"{len(unfinished)} unfinished rows continue" in second.stdout + second.stderr
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2]["partial/rows_continued"] == len(unfinished)  # none lost, none stale
    assert records[2]["partial/rows_dropped_stale"] == 0
    assert all(r["train/generated_tokens"] > 0 for r in records)
    assert records[2]["partial/mean_staleness"] > 0  # it trained tokens of older weights


SEPARATE = ["generation.placement=separate", "generation.gpus_per_node=1",
            "async_grpo.max_staleness=1"]  # fmt: skip


def test_partial_rollouts_on_a_generation_rank_one_step_off_resume_with_their_rows(tmp_path):
    """The generation rank cuts and continues rows as a colocated trainer does; each batch
    carries its rows in flight, so the trainer's checkpoint holds them and a resumed run hands
    them back to the generation rank: none lost. Tokens of older weights are trained within
    async_grpo.max_staleness + max_staleness_steps (the per-turn check)."""
    first = train(tmp_path, *PARTIAL, *SEPARATE, "grpo.max_num_steps=2", nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    state = json.loads((tmp_path / "checkpoints/step_000002/rollouts_rank0.json").read_text())
    [replica] = state["generators"]  # one generation replica
    unfinished = [r for g in replica["groups"] for r in g["rows"] if r["finish_reason"] is None]
    assert unfinished and all(1 <= len(r["token_ids"]) < 8 for r in unfinished)
    second = train(tmp_path, *PARTIAL, *SEPARATE, "grpo.max_num_steps=3", nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    trainer_log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert f"{len(unfinished)} unfinished rows continue" in trainer_log
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    # one-step-off; the resumed run's schedule starts at its checkpoint's weights (2)
    assert [r["async/weight_version"] for r in records] == [0.0, 0.0, 2.0]
    assert records[2]["partial/rows_continued"] == len(unfinished)  # none lost, none stale
    assert records[2]["partial/rows_dropped_stale"] == 0
    assert all(r["train/generated_tokens"] > 0 for r in records)
    assert any(r["partial/mean_staleness"] > 0 for r in records)  # continued rows trained
