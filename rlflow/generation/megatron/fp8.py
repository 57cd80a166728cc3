"""FP8 rollouts (`generation.fp8`): the decode step's layer matmuls in e4m3, on GPUs that have it.

A decode step at few live rows reads every weight once for a few rows of arithmetic: it is bound
by the weights' bytes, and FP8 halves them. Each of a layer's four matmul weights (QKV,
attention output, MLP in and out) gets an e4m3 copy with one fp32 scale per output channel
(scale = the channel's largest |w| / 448, e4m3's largest finite value); each matmul's input is
quantized the same way per row (per token) on the fly; torch's scaled matmul
(`torch._scaled_mm`, rowwise scales) multiplies them into bf16. The output head and the prefill
stay in the policy's dtype.

The engine reads the trainer's weights in place, so the FP8 copies go stale at every optimizer
step: `refresh_weights()` re-quantizes them in place (the decode step's CUDA graphs keep
pointing at the same buffers). FP8 rollouts come from a slightly different policy than the one
the trainer scores, so `loss.importance_sampling.mode: auto` turns TIS on for them
(rlflow/train/collect.py).

`torch._scaled_mm` with per-row scales needs an FP8 GPU (compute capability 8.9: Ada, Hopper and
newer); `require` refuses anything else before a model is loaded. `reference_linear` is the
same arithmetic in the input's dtype (dequantized operands), which the CPU tests run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlflow.errors import Diagnostic, RlflowError

FORMAT = torch.float8_e4m3fn
FORMAT_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_CAPABILITY = (8, 9)
_TINY = 1e-12  # an all-zero channel or row gets scale 1e-12 / 448, not 0 (no division by zero)


@dataclass
class QuantizedWeight:
    """An [N, K] weight as e4m3 values and one fp32 scale per output channel: w ~ value * scale."""

    value: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [1, N] float32 (the layout torch._scaled_mm takes for the right operand)


@dataclass
class LayerFP8:
    qkv: QuantizedWeight
    proj: QuantizedWeight
    fc1: QuantizedWeight
    fc2: QuantizedWeight


def supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def require(device: torch.device) -> None:
    """Refuse `generation.fp8: true` where no FP8 matmul exists (CPU, GPUs before Ada/Hopper)."""
    if supported(device):
        return
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        what = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    else:
        what = f"this rank's device ({device.type}) has no FP8 matmul"
    raise RlflowError(
        Diagnostic(
            "recipe.fp8-unsupported",
            f"`generation.fp8: true` needs a GPU with FP8 matmuls (compute capability 8.9 or "
            f"newer: L4/L40S, H100, H200, B200); {what}",
            help="set generation.fp8=false (bf16 rollouts), or run on FP8-capable GPUs",
        )
    )


def quantize_weight(weight: torch.Tensor) -> QuantizedWeight:
    value, scale = _quantize(weight.detach())
    return QuantizedWeight(value, scale.T.contiguous())


def requantize_(quantized: QuantizedWeight, weight: torch.Tensor) -> None:
    """Overwrite an FP8 copy from the weight's current values, in the same buffers."""
    value, scale = _quantize(weight.detach())
    quantized.value.copy_(value)
    quantized.scale.copy_(scale.T)


def dequantize(quantized: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    return (quantized.value.float() * quantized.scale.T).to(dtype)


def quantize_layer(w) -> LayerFP8:
    """FP8 copies of a decoder LayerWeights' four matmul weights."""
    return LayerFP8(*(quantize_weight(t) for t in _matmul_weights(w)))


def requantize_layer_(quantized: LayerFP8, w) -> None:
    for q, weight in zip((quantized.qkv, quantized.proj, quantized.fc1, quantized.fc2),
                         _matmul_weights(w)):  # fmt: skip
        requantize_(q, weight)


def linear(x: torch.Tensor, quantized: QuantizedWeight, bias: torch.Tensor | None = None):
    """x [M, K] @ w.T (+ bias) -> [M, N] in x's dtype, x quantized per row.

    On an FP8 GPU this is torch's scaled matmul; elsewhere the same arithmetic on dequantized
    operands (the engine never takes that path: `require` refuses FP8 there)."""
    if not x.is_cuda:
        return reference_linear(x, quantized, bias)
    x_value, x_scale = _quantize(x)
    out = torch._scaled_mm(
        x_value, quantized.value.T, scale_a=x_scale, scale_b=quantized.scale, out_dtype=x.dtype
    )
    return out if bias is None else out + bias


def reference_linear(x: torch.Tensor, quantized: QuantizedWeight, bias=None) -> torch.Tensor:
    """`linear` on dequantized operands: what a scaled matmul computes, up to summation order."""
    x_value, x_scale = _quantize(x)
    x_dequant = x_value.float() * x_scale
    out = (x_dequant @ dequantize(quantized, torch.float32).T).to(x.dtype)
    return out if bias is None else out + bias


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 values [M, K], fp32 scales [M, 1]) with x ~ values * scales per row."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_TINY) / FORMAT_MAX
    value = (x.float() / scale).clamp(-FORMAT_MAX, FORMAT_MAX).to(FORMAT)
    return value, scale


def _matmul_weights(w) -> tuple[torch.Tensor, ...]:
    return w.qkv_weight, w.proj_weight, w.fc1_weight, w.fc2_weight
