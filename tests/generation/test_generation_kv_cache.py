"""The paged KV cache: a cache too small for the rollout set changes no row's tokens.

A row that outgrows the cache is preempted and runs again from its prompt in a later pass
(rlflow/generation/megatron/schedule.py). Greedy decoding, fp32 on the CPU, the tiny Qwen2.5-VL (its
head scaled so that greedy decoding has no near-ties): a row's tokens are then the same in
any pass. (Under T=1 sampling a row's draws depend on its seed and step only, but a different
batch changes the fp32 matmuls by ~1e-6, and over 136 steps a draw near a boundary of the
inverse CDF can flip: the same holds for passes of different sizes, with or without paging.)
"""

from __future__ import annotations

import pytest
import torch

from rlflow.errors import RlflowError
from rlflow.generation.base import SamplingParams
from rlflow.generation.megatron.kv_cache import BLOCK, KVCache, blocks_for
from rlflow.generation.megatron.schedule import RESERVE_SHARE, admit
from tests.tiny import megatron_generation, mixed_prompts

G = 3  # samples per prompt
NEW = 2 * BLOCK + 8  # every row grows through two more blocks


@pytest.fixture(scope="module", name="rows")
def rows_fixture(tiny_processor):
    return [p for p in mixed_prompts(tiny_processor) for _ in range(G)]


def greedy_cap(stop: tuple[int, ...]) -> SamplingParams:
    """Greedy decoding of NEW tokens; `stop` (-1: none) ends rows."""
    return SamplingParams(NEW, 0.0, 1.0, 0, 5, stop, ignore_eos=stop == (-1,))


def run(policy, processor, rows, params, cache_tokens: int):
    engine = megatron_generation(
        policy, processor.tokenizer.pad_token_id, cache_tokens=cache_tokens
    )
    return engine.generate(rows, params), engine.last_timings


@pytest.fixture(scope="module", name="admitted_tokens")
def admitted_tokens_fixture(tiny_policy, rows):
    """A cache exactly as large as admitting every row takes: all rows start in one pass, and
    growing past their first blocks preempts some."""
    lengths = [len(tiny_policy.prompt_ids(p)) for p in rows]
    reserve = NEW // RESERVE_SHARE
    return sum(blocks_for(n + reserve) for n in lengths) * BLOCK


@pytest.mark.parametrize("stops", ["none", "some"])
def test_a_small_cache_preempts_rows_and_changes_no_token(
    tiny_policy, tiny_processor, rows, admitted_tokens, stops
):
    free = greedy_cap((-1,))
    if stops == "some":  # a token some rows sample and others never do plays EOS
        first, _ = run(tiny_policy, tiny_processor, rows, free, 0)
        counts = {t: sum(t in c.token_ids for c in first) for c in first for t in c.token_ids}
        free = greedy_cap((next(t for t, n in counts.items() if 0 < n < len(rows) // 2),))
    roomy, roomy_timings = run(tiny_policy, tiny_processor, rows, free, 0)
    tight, tight_timings = run(tiny_policy, tiny_processor, rows, free, admitted_tokens)
    assert roomy_timings["passes"] == 1 and roomy_timings["preempted"] == 0
    assert tight_timings["preempted"] > 0 and tight_timings["passes"] > 1
    assert [c.token_ids for c in tight] == [c.token_ids for c in roomy]
    for a, b in zip(tight, roomy):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        assert a.finish_reason == b.finish_reason
    if stops == "some":
        assert {c.finish_reason for c in tight} == {"stop", "length"}


def test_a_cache_of_one_row_splits_a_prompt_group_and_changes_no_token(
    tiny_policy, tiny_processor, rows
):
    params = greedy_cap((-1,))
    rows = rows[: G + 1]  # one prompt's G samples and the next prompt's first
    longest = max(len(tiny_policy.prompt_ids(p)) for p in rows) + NEW
    roomy, _ = run(tiny_policy, tiny_processor, rows, params, 0)
    tight, timings = run(tiny_policy, tiny_processor, rows, params, blocks_for(longest) * BLOCK)
    assert timings["passes"] >= 2  # the group was split over passes
    assert [c.token_ids for c in tight] == [c.token_ids for c in roomy]


def test_a_cache_that_cannot_hold_one_row_is_refused(tiny_policy, tiny_processor, rows):
    with pytest.raises(RlflowError, match="cannot hold one row") as error:
        run(tiny_policy, tiny_processor, rows, greedy_cap((-1,)), BLOCK)
    assert error.value.diagnostics[0].code == "recipe.kv-cache-size"
    assert "raise generation.kv_cache_tokens" in error.value.diagnostics[0].help


def test_admission_takes_whole_prompt_groups_while_they_fit():
    lengths = [100, 100, 10, 10, 200]  # rows 0-1: prompt 0; 2-3: prompt 1; 4: prompt 2
    row_prompt = [0, 0, 1, 1, 2]
    fits = dict(pending=[0, 1, 2, 3, 4], prompt_len=lengths, row_prompt=row_prompt, reserve=28,
                max_len=1000)  # fmt: skip
    # blocks: 2 + 2 (prompt 0), 1 + 1 (prompt 1), 4 (prompt 2)
    assert admit(**fits, free_blocks=10, max_rows=0) == [0, 1, 2, 3, 4]
    assert admit(**fits, free_blocks=9, max_rows=0) == [0, 1, 2, 3]
    assert admit(**fits, free_blocks=5, max_rows=0) == [0, 1]
    assert admit(**fits, free_blocks=3, max_rows=0) == [0]  # the first group cut to what fits
    assert admit(**fits, free_blocks=1, max_rows=0) == [0]  # and one row always
    assert admit(**fits, free_blocks=99, max_rows=3) == [0, 1]
    assert admit(**fits, free_blocks=99, max_rows=1) == [0, 1]  # a whole first group
    # a row's reserve never goes past the longest row the cache is sized for
    assert admit(**{**fits, "max_len": 120}, free_blocks=4, max_rows=0) == [0, 1]


def test_blocks_move_with_their_rows_and_come_back():
    cache = KVCache(1, blocks=9, rows=3, max_len=3 * BLOCK, kv_heads=1, head_dim=4,
                    dtype=torch.float32, device="cpu")  # fmt: skip
    cache.grow([BLOCK + 1, 1, 2 * BLOCK])  # 2 + 1 + 2 blocks
    assert cache.free_blocks == 8 - 5
    table = cache._host.clone()
    cache.release([1])
    cache.compact([2, 0])  # row 2 first, row 0 second; row 1 (freed) is gone
    assert cache._host[0, :2].tolist() == table[2, :2].tolist()
    assert cache._host[1, :2].tolist() == table[0, :2].tolist()
    assert cache._host[2].tolist() == [0] * cache.max_blocks  # scratch
    assert cache.missing([3 * BLOCK + 50, 0]) == 1  # capped below the scratch column
    cache.release_all()
    assert cache.free_blocks == 8
