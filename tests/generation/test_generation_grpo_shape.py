"""The GRPO-shaped engine: shared prompts, retired rows and batch size never change a row's tokens.

Sampling is per row (a hash of the row's seed and the step), so these are exact equalities under
T=1 sampling, not just under greedy decoding. fp32 on the CPU, the tiny Qwen2.5-VL.
"""

from __future__ import annotations

import pytest

from rlflow.generation.base import Prompt, SamplingParams
from rlflow.generation.megatron.engine import MegatronGeneration, batch_buckets
from tests.tiny import megatron_generation, mixed_prompts

G = 3  # samples per prompt


@pytest.fixture(scope="module", name="prompts")
def prompts_fixture(tiny_processor):
    return mixed_prompts(tiny_processor)


def rollouts(prompts: list[Prompt]) -> list[Prompt]:
    """Each prompt repeated G times in a row: the same object, as the train loop builds them."""
    return [p for p in prompts for _ in range(G)]


def sampled(n: int, stop: tuple[int, ...] = (-1,), seed: int = 11) -> SamplingParams:
    return SamplingParams(n, 1.0, 1.0, 0, seed, stop, ignore_eos=stop == (-1,))


def engine(policy, processor, **kwargs) -> MegatronGeneration:
    return megatron_generation(policy, processor.tokenizer.pad_token_id, **kwargs)


def tokens(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


@pytest.mark.parametrize("kind", ["image", "video", "text", "mixed"])
def test_shared_prompt_generation_equals_unshared(tiny_policy, tiny_processor, prompts, kind):
    picked = prompts if kind == "mixed" else [p for p in prompts if p.sample_id.startswith(kind)]
    rows = rollouts(picked)
    shared = engine(tiny_policy, tiny_processor).generate(rows, sampled(10))
    unshared = engine(tiny_policy, tiny_processor, share_prompts=False).generate(rows, sampled(10))
    assert tokens(shared) == tokens(unshared)
    for a, b in zip(shared, unshared):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    # the G samples of one prompt differ (they are samples, not copies)
    assert len({tuple(t) for t in tokens(shared)[:G]}) > 1


def test_each_prompt_is_prefilled_once(tiny_policy, tiny_processor, prompts):
    from rlflow.model.vision_cache import VisionCache

    cache = VisionCache(enabled=True)
    before = tiny_policy.vision_cache  # the session-wide policy's own (disabled) cache
    tiny_policy.vision_cache = cache
    try:
        engine(tiny_policy, tiny_processor).generate(rollouts(prompts), sampled(4))
    finally:
        tiny_policy.vision_cache = before
    assert cache.computed == sum(1 for p in prompts if p.media.num_images or p.media.num_videos)


def test_retiring_finished_rows_never_changes_the_other_rows(tiny_policy, tiny_processor, prompts):
    rows = rollouts(prompts)
    gen = engine(tiny_policy, tiny_processor)
    free = tokens(gen.generate(rows, sampled(24)))
    # A token some rows produce early and others never: as a stop token it retires those rows
    # mid-generation (the engine compacts its batch), while the others go on.
    counts = {t: sum(t in r[:12] for r in free) for r in free for t in r[:12]}
    stop = min((t for t, c in counts.items() if 0 < c < len(rows) // 2), key=lambda t: -counts[t])
    stopped = gen.generate(rows, sampled(24, stop=(stop,)))
    assert gen.last_timings["steps"] == 24
    for before, after in zip(free, stopped):
        if stop in before:
            cut = before.index(stop) + 1
            assert after.token_ids == before[:cut] and after.finish_reason == "stop"
        else:
            assert after.token_ids == before and after.finish_reason == "length"


def test_batch_size_never_changes_tokens(tiny_policy, tiny_processor, prompts):
    rows = rollouts(prompts)
    whole = engine(tiny_policy, tiny_processor).generate(rows, sampled(8))
    # passes of at most 4 rows keep prompt groups whole (G=3: one prompt per pass)
    chunked = engine(tiny_policy, tiny_processor, max_batch_size=4).generate(rows, sampled(8))
    assert tokens(whole) == tokens(chunked)


def test_batch_buckets_cover_every_size():
    buckets = batch_buckets(512)
    assert buckets[0] == 1 and buckets[-1] == 512
    assert all(b < a * 2 for b, a in zip(buckets[1:], buckets)) or buckets[:3] == [1, 2, 4]
    assert batch_buckets(5) == [1, 2, 4, 5]
