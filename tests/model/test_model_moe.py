"""rlflow's grouped experts against megatron-core's SequentialMLP (same checkpoint, same
parameter names): forward and every gradient equal within fp32 rounding; the dry run's expert
count from config.json."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlflow.model.media import Media
from rlflow.model.moe import experts as moe
from tests.tiny import FP32, SINGLE


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from rlflow.model.families.qwen3_moe import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(
        tmp_path_factory.mktemp("qwen3moe-grouped"), seed=0, lm_head_scale=8.0
    )


def _loss_and_grads(policy, ids, mask):
    from rlflow.model.packed_forward import pack_rows, target_logprobs

    core = policy.core
    for param in core.parameters():
        param.requires_grad_(True)
        param.grad = None
    targets = mask[:, 1:] & mask[:, :-1]
    rows = pack_rows(core, ids, mask, mask, targets, [Media()] * len(ids))
    logprobs, _ = target_logprobs(core, rows, (None, None), with_entropy=False)
    (logprobs * torch.linspace(-1, 1, logprobs.numel())).sum().backward()
    return logprobs.detach(), {n: p.grad for n, p in core.named_parameters()}


def test_grouped_experts_equal_sequential_forward_and_gradients(single_rank, moe_checkpoint):
    from rlflow.model.build import load_policy

    sequential_cfg = dataclasses.replace(
        FP32, moe=dataclasses.replace(FP32.moe, grouped_experts=False)
    )
    grouped = load_policy(moe_checkpoint, FP32, SINGLE, trainable=False)
    sequential = load_policy(moe_checkpoint, sequential_cfg, SINGLE, trainable=False)
    assert type(sequential.core.decoder.layers[0].mlp.experts).__name__ == "SequentialMLP"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (4, 24), generator=generator)
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[1, 15:] = mask[3, 7:] = False
    lp_grouped, grads_grouped = _loss_and_grads(grouped, ids, mask)
    lp_sequential, grads_sequential = _loss_and_grads(sequential, ids, mask)
    assert (lp_grouped - lp_sequential).abs().max() < 1e-5
    assert sorted(grads_grouped) == sorted(grads_sequential)
    expert_grads = 0
    for name, grad in grads_sequential.items():
        assert grads_grouped[name] is not None, name
        scale = grad.abs().max().clamp(min=1e-6)
        assert ((grads_grouped[name] - grad).abs().max() / scale) < 1e-4, name
        expert_grads += "local_experts" in name and bool(grad.abs().sum() > 0)
    assert expert_grads >= 8  # the routed experts really received gradients


def test_grouped_mm_loop_fallback_equals_the_kernel():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(13, 8, generator=generator)
    w = torch.randn(3, 6, 8, generator=generator)
    offsets = torch.tensor([4, 4, 13], dtype=torch.int32)
    expected = torch.cat([x[:4] @ w[0].T, x[4:13] @ w[2].T])
    assert torch.allclose(moe.grouped_mm(x, w, offsets), expected, atol=1e-6)  # kernel
    low = moe.grouped_mm(x.bfloat16(), w.bfloat16(), offsets)  # 6 x bf16: unaligned, a loop
    assert torch.allclose(low.float(), expected, atol=0.1)
    # the GPUs' way where the kernel cannot run (float32): every group's product, one per row
    padded = torch.cat([x, torch.randn(2, 8, generator=generator)])  # rows past the last end
    on_device = moe._grouped_mm_on_device(padded, w, offsets)
    assert torch.allclose(on_device[:13], expected, atol=1e-6)
    assert not on_device[13:].any()


def test_expert_count_from_config_json():
    assert moe.num_experts({"model_type": "qwen3_moe", "num_experts": 128}) == 128
    assert moe.num_experts({"text_config": {"num_experts": 64}}) == 64  # vision-language MoE
    assert moe.num_experts({"model_type": "mixtral", "num_local_experts": 8}) == 8
    assert moe.num_experts({"model_type": "qwen3"}) == 0
