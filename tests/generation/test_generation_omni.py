"""rlflow's Megatron engine on Nemotron Omni (tiny: RADIO + mlp1 + a Nemotron-H `M-*M-` language
model, fp32, CPU): image rows, a video row and a text row in one batch, several samples of each
prompt (one shared prefill, its Mamba states copied to each sample): greedy tokens equal the HF
model's (the family's, rlflow/model/families/nemotron_omni/hf.py) and logprobs equal HF's and the
packed trainer's for the same rows."""

from __future__ import annotations

import pytest
import torch

from rlflow.model.media import Media
from tests.tiny import FP32, SINGLE, greedy, megatron_generation, mixed_prompts


@pytest.fixture(scope="module")
def omni(single_rank, family_ckpt):
    from rlflow.model.build import load_policy
    from rlflow.model.processor import CheckpointProcessor

    path = family_ckpt("tiny-nemotron-omni")
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    processor = CheckpointProcessor(path)
    return policy, processor, mixed_prompts(processor.processor)


def _tokens(completions) -> list[list[int]]:
    return [c.token_ids for c in completions]


def test_media_rows_equal_hf_greedy_and_the_trainers_logprobs(omni):
    """[image, image, text, video, video, image, image]: two samples of three prompts, shared
    prefills, every row's 24 greedy tokens HF's, its logprobs HF's and the packed trainer's."""
    from rlflow.generation.hf import HFGeneration
    from rlflow.model.packed_forward import pack_rows, target_logprobs

    policy, processor, prompts = omni
    pad, eos = processor.pad_token_id, processor.tokenizer.eos_token_id
    assert [p.sample_id.split("-")[0] for p in prompts] == ["image", "text", "video", "image"]
    assert policy.family.megatron_engine
    params = greedy(24, eos)
    order = [0, 0, 1, 2, 2, 3, 3]
    rows = [prompts[i] for i in order]
    engine = megatron_generation(policy, pad)
    ours = engine.generate(rows, params)
    hf = HFGeneration(policy, pad, 1).generate(prompts, params)  # one prompt a batch: no padding
    ref = [hf[i] for i in order]
    assert _tokens(ours) == _tokens(ref)
    assert all(len(c.token_ids) == 24 for c in ours)
    for a, b in zip(ours, ref):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # the trainer's packed forward over prompt + completion (vision features at the prompt's
    # pad tokens only) scores the engine's logprobs
    sequences = [list(p.token_ids) + c.token_ids for p, c in zip(rows, ours)]
    width = max(len(r) for r in sequences)
    ids = torch.full((len(sequences), width), pad)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    prompt_mask = torch.zeros(ids.shape, dtype=torch.bool)
    targets = torch.zeros(len(sequences), width - 1, dtype=torch.bool)
    for i, (row, prompt) in enumerate(zip(sequences, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
        prompt_mask[i, : len(prompt.token_ids)] = True
        targets[i, len(prompt.token_ids) - 1 : len(row) - 1] = True
    media = [p.media for p in rows]
    with torch.no_grad():
        packed = pack_rows(policy.core, ids, mask, prompt_mask, targets, media)
        features = policy.family.vision_features(policy.core, Media.concat(media))
        trainer, _ = target_logprobs(policy.core, packed, features, with_entropy=False)
    engine_lp = torch.tensor([x for c in ours for x in c.logprobs])
    assert (trainer - engine_lp).abs().max() < 1e-4
    assert float(torch.exp((trainer - engine_lp).abs().mean())) < 1.0 + 1e-5


def test_shared_media_prefill_and_passes_never_change_a_rows_tokens(omni):
    """T=1 sampling (a row's draws depend on its seed only), samples of a video and an image
    prompt: sharing each prompt's tower run and prefill equals every row alone, and a KV cache
    so small that the rows run in several passes (the tower's features reused) changes
    nothing."""
    from rlflow.generation.base import SamplingParams

    policy, processor, prompts = omni
    pad = processor.pad_token_id
    rows = [prompts[2]] * 2 + [prompts[0]] * 3 + [prompts[1]]  # 97, 48, 26 prompt tokens
    params = SamplingParams(24, 1.0, 1.0, 0, seed=3, stop_token_ids=(-1,), ignore_eos=True)
    first = megatron_generation(policy, pad).generate(rows, params)
    shared = _tokens(first)
    assert len({tuple(t) for t in shared[2:5]}) > 1  # samples, not copies
    unshared = megatron_generation(policy, pad, share_prompts=False).generate(rows, params)
    small = megatron_generation(policy, pad, cache_tokens=192)  # 3 blocks of 64 tokens
    passes = small.generate(rows, params)
    for other in (unshared, passes):
        assert _tokens(other) == shared
        for a, b in zip(first, other):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert small.last_timings["passes"] > 1, small.last_timings
