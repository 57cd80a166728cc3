"""One GRPO update on the real Megatron policy moves probability toward rewarded completions."""

from __future__ import annotations

import pytest
import torch

from rlflow.generation.base import SamplingParams
from rlflow.recipe.schema import (
    ImportanceSamplingConfig,
    LossConfig,
    OptimizerConfig,
    OverlongPenaltyConfig,
)
from rlflow.train import grpo
from rlflow.train.rollouts import build_train_batch
from rlflow.train.update import Batching, Optimizer, grpo_update, rollout_logprobs
from tests.tiny import FP32, SINGLE, make_prompt, megatron_generation


@pytest.fixture(scope="module")
def trainable(single_rank, tiny_ckpt):
    from rlflow.model.build import load_policy

    return load_policy(tiny_ckpt, FP32, SINGLE, trainable=True)


def test_update_raises_logprob_of_rewarded_answers(trainable, tiny_processor):
    policy = trainable
    prompt = make_prompt(tiny_processor, "image", "How many red squares are there?")
    prompts = [prompt] * 16
    gen = megatron_generation(policy, tiny_processor.tokenizer.pad_token_id, max_batch_size=16)
    completions = gen.generate(
        prompts, SamplingParams(3, 1.5, 1.0, 0, seed=3, stop_token_ids=(), ignore_eos=True)
    )
    first = [c.token_ids[0] for c in completions]
    target = max(set(first), key=first.count)
    assert 0 < first.count(target) < len(first), (
        "the sample needs both rewarded and unrewarded rows"
    )
    rewards = torch.tensor([[1.0 if t == target else 0.0 for t in first]])
    advantages = (
        grpo.group_advantages(rewards, leave_one_out=True, normalize=True).flatten().tolist()
    )
    batch = build_train_batch(
        prompts,
        completions,
        advantages,
        prompt_ids=policy.prompt_ids,
        pad_token_id=tiny_processor.tokenizer.pad_token_id,
    )
    batching = Batching(8, max_tokens=0, packed=True)
    before, _ = rollout_logprobs(policy, batch, batching, with_entropy=False, router_replay=False)
    weights_before = [p.detach().clone() for p in policy.core.language_model.parameters()]
    optimizer_cfg = OptimizerConfig(
        lr=1e-3,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        max_grad_norm=1.0,
        micro_batch_size=8,
        max_tokens_per_micro_batch=0,
        sequence_packing=True,
    )
    optimizer = Optimizer.from_config(policy, optimizer_cfg)
    loss_cfg = LossConfig(
        ratio_clip_low=0.2,
        ratio_clip_high=0.28,
        kl_penalty=0.0,
        kl_type="k3",
        token_level_loss=True,
        ratio_level="token",
        overlong_penalty=OverlongPenaltyConfig(enabled=False, buffer_tokens=0, penalty=0.0),
        importance_sampling=ImportanceSamplingConfig(mode="off", cap=2.0, mask_below=0.0),
        router_replay=True,
        stop_on_mult_prob_error=None,  # (read by the loop, not by the update)
    )
    metrics = grpo_update(
        policy,
        optimizer,
        batch,
        old_logprobs=before,
        ref_logprobs=None,
        loss_cfg=loss_cfg,
        batching=Batching.from_config(optimizer_cfg),
        num_minibatches=1,
    ).metrics
    after, _ = rollout_logprobs(policy, batch, batching, with_entropy=False, router_replay=False)

    changed = [
        not torch.equal(a, p)
        for a, p in zip(weights_before, policy.core.language_model.parameters())
    ]
    assert any(changed) and metrics["grad_norm"] > 0
    start = batch.target_mask.float().argmax(dim=1)  # first generated target position per row
    rows = torch.arange(len(batch))
    gain = after[rows, start] - before[rows, start]
    rewarded = torch.tensor([t == target for t in first])
    assert gain[rewarded].mean() > 0 > gain[~rewarded].mean()
