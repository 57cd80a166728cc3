"""FP8 rollouts (rlflow/generation/megatron/fp8.py): quantization numerics, refusal, and the plumbing.

This machine has no FP8 matmul (torch's scaled matmul needs an FP8 GPU), so the engine refuses
`fp8=True` here; the plumbing tests replace that check (and only it) and run the engine on the
reference path, the same arithmetic on dequantized operands. The compiled FP8 matmul is
measured on the H200 by benchmarks/grpo_shaped.py --variants fp8.
"""

from __future__ import annotations

import pytest
import torch

from rlflow.errors import RlflowError
from rlflow.generation.base import SamplingParams
from rlflow.generation.megatron import fp8
from tests.slurm.jobs import rlflow
from tests.tiny import TINY_CPU_RECIPE, megatron_generation, mixed_prompts


def test_per_channel_quantization_round_trips_within_e4m3_precision():
    torch.manual_seed(0)
    weight = torch.randn(48, 64) * torch.logspace(-3, 2, 48)[:, None]  # channels of any scale
    weight[5] = 0.0  # an all-zero channel: no division by zero, dequantizes to zero
    q = fp8.quantize_weight(weight)
    assert q.value.dtype == torch.float8_e4m3fn and q.scale.shape == (1, 48)
    back = fp8.dequantize(q, torch.float32)
    assert torch.equal(back[5], torch.zeros(64))
    # each channel's largest magnitude maps to e4m3's largest value; 3 mantissa bits: <= 2^-4
    assert torch.allclose(
        q.value.float().abs().amax(1)[weight.abs().amax(1) > 0], torch.tensor(448.0)
    )
    error = (back - weight).abs() / weight.abs().amax(1, keepdim=True).clamp(min=1e-30)
    assert float(error.max()) <= 2**-4
    # the scaled-matmul reference: per-row activations, per-channel weights
    x = torch.randn(7, 64)
    out = fp8.reference_linear(x, q)
    exact = x @ weight.T
    assert float((out - exact).norm() / exact.norm()) < 0.05


def test_requantize_overwrites_the_same_buffers():
    weight = torch.randn(32, 16)
    q = fp8.quantize_weight(weight)
    pointers = (q.value.data_ptr(), q.scale.data_ptr())
    weight.mul_(3.0).add_(1.0)  # an optimizer step, in place
    fp8.requantize_(q, weight)
    fresh = fp8.quantize_weight(weight)
    assert (q.value.data_ptr(), q.scale.data_ptr()) == pointers  # CUDA graphs keep pointing here
    assert torch.equal(q.value.view(torch.uint8), fresh.value.view(torch.uint8))
    assert torch.equal(q.scale, fresh.scale)


def test_the_dry_run_refuses_fp8_where_it_cannot_run():
    # the CPU recipe (float32) on a CPU-only cluster: both reasons, the keys that set them, exit 2
    done = rlflow("submit", "--dry-run", str(TINY_CPU_RECIPE), "--nodes", "1", "--gpus", "1",
                  "generation.fp8=true", "slurm.request_gpus=false")  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "`generation.fp8: true` needs `model.dtype: bfloat16`, not `float32`" in done.stderr
    assert "help: set model.dtype=bfloat16, or generation.fp8=false" in done.stderr
    assert "but `slurm.request_gpus: false` says the job runs on CPUs" in done.stderr


def test_fp8_is_refused_without_an_fp8_gpu(tiny_policy):
    with pytest.raises(RlflowError) as caught:
        megatron_generation(tiny_policy, 0, fp8=True)
    text = caught.value.diagnostics[0].render()
    assert "recipe.fp8-unsupported" in text and "generation.fp8=false" in text


def test_fp8_rollouts_track_the_policy_and_its_updates(tiny_policy, tiny_processor, monkeypatch):
    # No FP8 matmul on this CPU: only the capability check is replaced, the engine then runs
    # its FP8 layer weights through fp8.reference_linear (module docstring).
    monkeypatch.setattr(fp8, "require", lambda device: None)
    prompts = mixed_prompts(tiny_processor)
    params = SamplingParams(6, 1.0, 1.0, 0, 3, (-1,), True)  # T=1, 6 tokens, seed 3
    pad = tiny_processor.tokenizer.pad_token_id
    exact = megatron_generation(tiny_policy, pad).generate(prompts, params)
    engine = megatron_generation(tiny_policy, pad, fp8=True)
    quantized = engine.generate(prompts, params)
    assert engine._decoder.fp8 and engine._decoder._decode_layers[0].quantized is not None
    # the first token comes from the prefill (not quantized): the same draw, the same logprob
    for a, b in zip(exact, quantized):
        assert a.token_ids[0] == b.token_ids[0] and abs(a.logprobs[0] - b.logprobs[0]) < 1e-5
    gaps = []  # logprob gaps while a row's tokens still agree
    for a, b in zip(exact, quantized):
        for n in range(1, len(a.token_ids)):
            if a.token_ids[n] != b.token_ids[n]:
                break
            gaps.append(abs(a.logprobs[n] - b.logprobs[n]))
    assert 0 < max(gaps) < 0.5  # quantized, and close

    # an optimizer step changes the weights in place; refresh_weights re-quantizes them
    weight = engine._decoder.layers[0].fc1_weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-1.5)
        engine.refresh_weights()
        after = engine.generate(prompts, params)
        fresh = megatron_generation(tiny_policy, pad, fp8=True).generate(prompts, params)
        assert [c.token_ids for c in after] == [c.token_ids for c in fresh]
        assert [c.logprobs for c in after] == [c.logprobs for c in fresh]
    finally:
        with torch.no_grad():
            weight.copy_(saved)
