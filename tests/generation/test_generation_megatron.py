"""Megatron generation (batched prefill, KV cache) against the HF reference backend, same weights."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from rlflow.generation.base import Prompt, SamplingParams
from tests.tiny import greedy, megatron_generation, mixed_prompts


@pytest.fixture(scope="module", name="mixed_prompts")
def mixed_prompts_fixture(tiny_processor):
    return mixed_prompts(tiny_processor)


@pytest.fixture(scope="module")
def backends(tiny_policy, tiny_processor):
    from rlflow.generation.hf import HFGeneration

    pad = tiny_processor.tokenizer.pad_token_id
    megatron = megatron_generation(tiny_policy, pad, max_batch_size=8)
    return megatron, HFGeneration(tiny_policy, pad, 8)


def test_greedy_tokens_and_logprobs_match_reference(backends, mixed_prompts, tiny_processor):
    megatron, hf = backends
    params = greedy(24, tiny_processor.tokenizer.eos_token_id)
    ours, ref = megatron.generate(mixed_prompts, params), hf.generate(mixed_prompts, params)
    for prompt, a, b in zip(mixed_prompts, ours, ref):
        assert a.token_ids == b.token_ids, prompt.sample_id
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4, prompt.sample_id


def test_batched_equals_one_by_one(backends, mixed_prompts, tiny_processor):
    megatron, _ = backends
    params = greedy(12, tiny_processor.tokenizer.eos_token_id)
    together = megatron.generate(mixed_prompts, params)
    alone = [megatron.generate([p], params)[0] for p in mixed_prompts]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


def test_rows_stop_at_eos_independently(backends, mixed_prompts):
    megatron, _ = backends
    free = megatron.generate(mixed_prompts, greedy(8, eos=-1))
    # A token some rows produce and others never do: it plays EOS, so only some rows stop early.
    counts = {t: sum(t in c.token_ids for c in free) for c in free for t in c.token_ids}
    stop_token = next(t for t, n in counts.items() if 0 < n < len(free))
    stopped = megatron.generate(mixed_prompts, greedy(8, eos=stop_token, ignore_eos=False))
    for before, after in zip(free, stopped):
        if stop_token in before.token_ids:
            cut = before.token_ids.index(stop_token) + 1
            assert after.token_ids == before.token_ids[:cut] and after.finish_reason == "stop"
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"
        assert len(after.logprobs) == len(after.token_ids)


def test_sampling_is_seeded(backends, mixed_prompts, tiny_processor):
    megatron, _ = backends
    eos = tiny_processor.tokenizer.eos_token_id
    params = SamplingParams(16, 1.0, 0.9, 50, seed=7, stop_token_ids=(eos,), ignore_eos=True)
    first = megatron.generate(mixed_prompts, params)
    again = megatron.generate(mixed_prompts, params)
    other = megatron.generate(mixed_prompts, SamplingParams(16, 1.0, 0.9, 50, 8, (eos,), True))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]


def test_a_prompt_whose_pad_tokens_do_not_match_its_media_is_refused(
    tiny_policy, mixed_prompts, backends, tiny_processor
):
    """The processor's prompt holds one pad token per visual embedding; one that does not (a
    prompt expanded twice, or never) is refused before any backend runs it."""
    expanded = mixed_prompts[0]
    assert tiny_policy.prompt_ids(expanded) == list(expanded.token_ids)
    pad = tiny_policy.media_tokens.image
    compact_ids = []
    for token in expanded.token_ids:  # collapse the run of pads into one placeholder
        if not (token == pad and compact_ids and compact_ids[-1] == pad):
            compact_ids.append(token)
    compact = Prompt(expanded.sample_id, expanded.text, tuple(compact_ids), expanded.media)
    megatron, _ = backends
    with pytest.raises(ValueError, match="its media need"):
        megatron.generate([compact], greedy(2, tiny_processor.tokenizer.eos_token_id))


def test_generation_keeps_no_cache_alive(backends, mixed_prompts, tiny_processor):
    """Alternating with training must not accumulate KV caches: nothing outlives generate()."""
    import rlflow.generation.megatron.engine as engine

    megatron, _ = backends
    caches = []
    original = engine.KVCache.__init__

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        caches.append(weakref.ref(self))

    engine.KVCache.__init__ = tracking_init
    try:
        megatron.generate(mixed_prompts, greedy(4, tiny_processor.tokenizer.eos_token_id))
    finally:
        engine.KVCache.__init__ = original
    gc.collect()
    assert caches and all(ref() is None for ref in caches)
    assert torch.is_grad_enabled()
