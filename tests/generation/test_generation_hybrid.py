"""rlflow's Megatron engine on a hybrid model (tiny Nemotron-H: Mamba-2 + attention + MLP, fp32,
CPU): greedy tokens equal HF's for 64 tokens and its logprobs equal HF's and the trainer's;
batched rows of different lengths, a prompt's samples (one shared prefill, its Mamba state
copied to each sample) and passes that reuse retired rows' state slots all equal rows run one at
a time; a slot given back and given again starts from zeros."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.tiny import (
    completion_rows,
    greedy,
    greedy_batch_equals_hf,
    megatron_generation,
    packed_logprobs,
    prefill_sharing_changes_nothing,
    text_prompts,
)


@pytest.fixture(scope="module")
def hybrid(hybrid_policy):
    policy, tokenizer, _ = hybrid_policy
    prompts = text_prompts(tokenizer)
    return policy, tokenizer, prompts


def _engine(hybrid, **changes):
    policy, tokenizer, _ = hybrid
    return megatron_generation(policy, tokenizer.pad_token_id, **changes)


def test_greedy_rows_equal_hf_for_64_tokens_and_the_trainers_logprobs(hybrid):
    """Prompts of different lengths, 2 samples of two of them, in one batch: each row's 64 greedy
    tokens are HF's for its prompt, its logprobs HF's and the packed trainer's; a row run alone
    draws what it draws in the batch."""
    policy, tokenizer, prompts = hybrid
    engine = _engine(hybrid)
    _, ours = greedy_batch_equals_hf(engine, policy, tokenizer, prompts)
    [alone] = engine.generate([prompts[1]], greedy(16, tokenizer.eos_token_id))
    assert alone.token_ids == ours[2].token_ids[:16]
    # the trainer's packed forward over prompt + completion scores the same logprobs
    unique = [ours[0], ours[2], ours[3]]
    ids, mask, targets = completion_rows(prompts, unique, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = packed_logprobs(policy, ids, mask, targets)
    engine_lp = torch.tensor([x for c in unique for x in c.logprobs])
    assert (trainer - engine_lp).abs().max() < 1e-4
    assert float(torch.exp((trainer - engine_lp).abs().mean())) < 1.0 + 1e-5


def test_shared_prefill_and_reused_slots_never_change_a_rows_tokens(hybrid):
    """T=1 sampling (a row's draws depend on its seed only), 3 samples per prompt: sharing each
    prompt's prefill (its Mamba states copied to its samples) equals prefilling every row
    alone; a KV cache so small that the rows run in several passes (each taking the state
    slots the last one gave back) and some are preempted mid-generation changes nothing."""
    _, _, prompts = hybrid  # prompts 2 and 1: 43 and 26 tokens, so 24 more cross a block
    prefill_sharing_changes_nothing(partial(_engine, hybrid), prompts)


def test_a_released_slot_is_given_again_zeroed():
    from rlflow.generation.megatron.mamba_state import HybridCache
    from tests.generation.test_generation_mamba_state import _weights

    cache = HybridCache(
        [_weights()], 1, blocks=8, rows=3, max_len=64, kv_heads=1, head_dim=8,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    cache.grow([5, 5, 0])
    cache.upload()
    first, second = cache.slot_table.tolist()[:2]
    assert 0 not in (first, second) and cache.slot_table[2] == 0  # 0: scratch, no row
    cache.states.conv[:, first] = 1.0
    cache.states.ssm[:, first] = 1.0
    cache.release([0])  # row 0 retired: its slot is free, its position points at scratch
    cache.compact([1, 0])
    cache.grow([6, 5, 0])
    cache.upload()
    assert cache.slot_table.tolist() == [second, first, 0]  # position 1 took the freed slot
    assert float(cache.states.conv[:, first].abs().sum()) == 0.0
    assert float(cache.states.ssm[:, first].abs().sum()) == 0.0
