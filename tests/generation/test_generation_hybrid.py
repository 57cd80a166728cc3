"""rlflow's Megatron engine on a hybrid model (tiny Nemotron-H: Mamba-2 + attention + MLP, fp32,
CPU): greedy tokens equal HF's for 64 tokens and its logprobs equal HF's and the trainer's;
batched rows of different lengths, a prompt's samples (one shared prefill, its Mamba state
copied to each sample) and passes that reuse retired rows' state slots all equal rows run one at
a time; a slot given back and given again starts from zeros."""

from __future__ import annotations

import pytest
import torch

from rlflow.generation.base import SamplingParams
from rlflow.model.media import Media
from tests.tiny import greedy, megatron_generation, text_prompt

QUESTIONS = [
    "How many red squares are there?",
    "Count.",
    "A picture shows a large blue triangle and a small red circle. How many circles?",
]


@pytest.fixture(scope="module")
def hybrid(hybrid_policy):
    policy, tokenizer, _ = hybrid_policy
    prompts = [text_prompt(tokenizer, q, f"text-{i}") for i, q in enumerate(QUESTIONS)]
    return policy, tokenizer, prompts


def _engine(hybrid, **changes):
    policy, tokenizer, _ = hybrid
    return megatron_generation(policy, tokenizer.pad_token_id, **changes)


def _tokens(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


def test_greedy_rows_equal_hf_for_64_tokens_and_the_trainers_logprobs(hybrid):
    """Prompts of different lengths, 2 samples of two of them, in one batch: each row's 64 greedy
    tokens are HF's for its prompt, its logprobs HF's and the packed trainer's; a row run alone
    draws what it draws in the batch."""
    from rlflow.generation.hf import HFGeneration
    from rlflow.model.packed_forward import pack_rows, target_logprobs

    policy, tokenizer, prompts = hybrid
    params = greedy(64, tokenizer.eos_token_id)
    rows = [prompts[0], prompts[0], prompts[1], prompts[2], prompts[2]]
    engine = _engine(hybrid)
    ours = engine.generate(rows, params)
    hf = HFGeneration(policy, tokenizer.pad_token_id, 8).generate(prompts, params)
    ref = [hf[0], hf[0], hf[1], hf[2], hf[2]]
    assert _tokens(ours) == _tokens(ref)
    assert all(len(c.token_ids) == 64 for c in ours)
    for a, b in zip(ours, ref):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    [alone] = engine.generate([prompts[1]], greedy(16, tokenizer.eos_token_id))
    assert alone.token_ids == ours[2].token_ids[:16]
    # the trainer's packed forward over prompt + completion scores the same logprobs
    unique = [ours[0], ours[2], ours[3]]
    sequences = [list(p.token_ids) + c.token_ids for p, c in zip(prompts, unique)]
    width = max(len(r) for r in sequences)
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    targets = torch.zeros(len(sequences), width - 1, dtype=torch.bool)
    for i, (row, prompt) in enumerate(zip(sequences, prompts)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
        targets[i, len(prompt.token_ids) - 1 : len(row) - 1] = True
    with torch.no_grad():
        packed = pack_rows(policy.core, ids, mask, mask, targets, [Media()] * len(sequences))
        trainer, _ = target_logprobs(policy.core, packed, (None, None), with_entropy=False)
    engine_lp = torch.tensor([x for c in unique for x in c.logprobs])
    assert (trainer - engine_lp).abs().max() < 1e-4
    assert float(torch.exp((trainer - engine_lp).abs().mean())) < 1.0 + 1e-5


def test_shared_prefill_and_reused_slots_never_change_a_rows_tokens(hybrid):
    """T=1 sampling (a row's draws depend on its seed only), 3 samples per prompt: sharing each
    prompt's prefill (its Mamba states copied to its samples) equals prefilling every row
    alone; a KV cache so small that the rows run in several passes (each taking the state
    slots the last one gave back) and some are preempted mid-generation changes nothing."""
    _, _, prompts = hybrid
    rows = [prompts[2]] * 3 + [prompts[1]] * 2  # 43 and 26 prompt tokens: 24 more cross a block
    params = SamplingParams(24, 1.0, 1.0, 0, seed=5, stop_token_ids=(-1,), ignore_eos=True)
    first = _engine(hybrid).generate(rows, params)
    shared = _tokens(first)
    assert len({tuple(t) for t in shared[:3]}) > 1  # samples, not copies
    unshared = _engine(hybrid, share_prompts=False).generate(rows, params)
    small = _engine(hybrid, cache_tokens=192)  # 3 blocks of 64 tokens
    passes = small.generate(rows, params)
    for other in (unshared, passes):
        assert _tokens(other) == shared
        for a, b in zip(first, other):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert small.last_timings["passes"] > 1 and small.last_timings["preempted"] > 0


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
