"""vLLM (its own environment, a worker process) against the Megatron backend and HF: same weights.

Real vLLM 0.32 (CPU build), fp32, the tiny Qwen2.5-VL: image, video and text prompts in one
batch must give identical greedy tokens in all three backends, and logprobs within 1e-4, before
and after the policy's weights change and are refreshed into vLLM.
"""

from __future__ import annotations

import pytest
import torch

from rlflow.generation.base import Prompt, SamplingParams
from tests.generation.conftest import leftover_weight_files
from tests.tiny import FP32, SINGLE, greedy, megatron_generation, mixed_prompts

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def policy(single_rank, tiny_ckpt):
    """A policy of this module's own: the refresh test changes its weights."""
    from rlflow.model.build import load_policy

    return load_policy(tiny_ckpt, FP32, SINGLE, trainable=False)


@pytest.fixture(scope="module")
def prompts(tiny_processor):
    return mixed_prompts(tiny_processor)


@pytest.fixture(scope="module")
def backends(policy, tiny_processor, vllm_env, vllm_gen_cfg, tmp_path_factory):
    from rlflow.generation.hf import HFGeneration
    from rlflow.generation.vllm.client import VLLMGeneration

    pad = tiny_processor.tokenizer.pad_token_id
    vllm = VLLMGeneration(
        policy, vllm_gen_cfg, tmp_path_factory.mktemp("vllm-run"), max_model_len=1024
    )
    yield vllm, megatron_generation(policy, pad, max_batch_size=8), HFGeneration(policy, pad, 8)
    vllm.close()
    assert not vllm.worker.alive()  # stopped by PID, nothing left running


def assert_same(prompts, ours, reference, name: str) -> None:
    for prompt, a, b in zip(prompts, ours, reference, strict=True):
        assert a.token_ids == b.token_ids, f"{prompt.sample_id}: vllm vs {name}"
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < TOLERANCE, (
            prompt.sample_id
        )


def test_greedy_tokens_and_logprobs_match_megatron_and_hf(backends, prompts, tiny_processor):
    vllm, megatron, hf = backends
    params = greedy(24, tiny_processor.tokenizer.eos_token_id)
    ours = vllm.generate(prompts, params)
    assert_same(prompts, ours, megatron.generate(prompts, params), "megatron")
    assert_same(prompts, ours, hf.generate(prompts, params), "hf")
    assert all(len(c.token_ids) == len(c.logprobs) == 24 for c in ours)


def test_parity_holds_after_the_policy_changes_and_is_refreshed(
    backends, policy, prompts, tiny_processor
):
    vllm, megatron, hf = backends
    params = greedy(16, tiny_processor.tokenizer.eos_token_id)
    before = vllm.generate(prompts, params)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # every weight moves, the vision tower's included
        for param in policy.core.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5 * param.abs().mean())
    seconds = vllm.refresh_weights()
    hf.refresh_weights()
    assert not leftover_weight_files(
        vllm
    )  # the file lived only for the reload (in RAM on /dev/shm)
    after = vllm.generate(prompts, params)
    assert seconds > 0
    assert all(
        a.token_ids != b.token_ids for a, b in zip(before, after, strict=True)
    )  # new weights in use
    assert_same(prompts, after, megatron.generate(prompts, params), "megatron")
    assert_same(prompts, after, hf.generate(prompts, params), "hf")


def test_logprobs_are_the_unmodified_distribution_the_trainer_recomputes(
    backends, policy, prompts, tiny_processor
):
    """Sampled with temperature, top-k and top-p: vLLM still reports log p at temperature 1."""
    from rlflow.train.rollouts import build_train_batch
    from rlflow.train.update import Batching, rollout_logprobs

    vllm, _, _ = backends
    tokenizer = tiny_processor.tokenizer
    params = SamplingParams(
        12, 0.7, 0.9, 20, seed=3, stop_token_ids=(tokenizer.eos_token_id,), ignore_eos=True
    )
    completions = vllm.generate(prompts, params)
    batch = build_train_batch(
        prompts,
        completions,
        [0.0] * len(prompts),
        prompt_ids=policy.prompt_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    trainer_logprobs, _ = rollout_logprobs(
        policy,
        batch,
        Batching(8, max_tokens=0, packed=True),
        with_entropy=False,
        router_replay=False,
    )
    gap = (batch.gen_logprobs - trainer_logprobs).abs()[batch.target_mask]
    assert float(gap.max()) < TOLERANCE


def test_sampling_is_seeded_and_every_row_samples_its_own(backends, prompts, tiny_processor):
    vllm, _, _ = backends
    eos = tiny_processor.tokenizer.eos_token_id
    group = [prompts[1]] * 4  # one prompt, four generations (a GRPO group)
    params = SamplingParams(16, 1.0, 1.0, 0, seed=7, stop_token_ids=(eos,), ignore_eos=True)
    first = vllm.generate(group, params)
    again = vllm.generate(group, params)
    other = vllm.generate(group, SamplingParams(16, 1.0, 1.0, 0, 8, (eos,), True))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    assert len({tuple(c.token_ids) for c in first}) > 1


def test_rows_stop_at_stop_tokens_independently_like_megatron(backends, prompts):
    vllm, megatron, _ = backends
    free = vllm.generate(prompts, greedy(8, eos=-1))
    counts = {t: sum(t in c.token_ids for c in free) for c in free for t in c.token_ids}
    stop_token = next(t for t, n in counts.items() if 0 < n < len(free))
    params = greedy(8, eos=stop_token, ignore_eos=False)
    stopped = vllm.generate(prompts, params)
    for before, after in zip(free, stopped, strict=True):
        if stop_token in before.token_ids:
            cut = before.token_ids.index(stop_token) + 1  # the stop token is kept, as in Megatron
            assert after.token_ids == before.token_ids[:cut] and after.finish_reason == "stop"
        else:
            assert after.token_ids == before.token_ids and after.finish_reason == "length"
    assert [c.token_ids for c in stopped] == [
        c.token_ids for c in megatron.generate(prompts, params)
    ]


def test_a_prompt_whose_tokens_vllm_does_not_reproduce_is_refused(
    backends, prompts, tiny_processor
):
    """The trainer scores the tokens it holds; if vLLM saw another prompt, logprobs are meaningless."""
    vllm, _, _ = backends
    text = prompts[1]
    assert "How many?" in text.text
    wrong = Prompt(
        text.sample_id,
        text.text.replace("How many?", "How few?"),
        text.token_ids,
        text.media,
    )
    params = greedy(2, tiny_processor.tokenizer.eos_token_id)
    with pytest.raises(RuntimeError, match="differ from the trainer's"):
        vllm.generate([wrong], params)
    assert len(vllm.generate([text], params)[0].token_ids) == 2  # a data error, not a dead backend
