"""Causal attention over packed sequences: many rows laid end to end, no padding, no cross-talk.

A packed batch is one long sequence [T, heads, head_dim] plus `cu_seqlens` (row starts, then T):
each token attends to the earlier tokens of its own row only. Two users:

* the trainer's logprob passes and update: megatron-core's local attention (the only one without
  Transformer Engine) takes a padded [B, T, T] mask and materialises the scores, so `install()`
  gives each layer's core attention a packed path, switched on by `packing(...)` around a forward;
* generation's prefill (rlflow/generation/megatron/decoder.py), which runs each unique prompt once.

On a GPU in bf16/fp16 this is one FlashAttention varlen call (torch.nn.attention.varlen, with
grouped-query attention natively); elsewhere (CPU, fp32) one SDPA call per group of equal-length
rows, which is exact and is what the parity tests compare against the padded path.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Packing:
    """Row boundaries of a packed batch: cu_seqlens [R+1] (int32, on the batch's device)."""

    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]  # the same on the host: row lengths, in order
    max_len: int

    @staticmethod
    def of(lengths: list[int], device) -> Packing:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        tensor = torch.tensor(cu, dtype=torch.int32, device=device)
        return Packing(tensor, tuple(lengths), max(lengths))

    @property
    def total(self) -> int:
        return int(sum(self.lengths))


_CURRENT: contextvars.ContextVar[Packing | None] = contextvars.ContextVar("packing", default=None)


@contextlib.contextmanager
def packing(pack: Packing):
    """Within this block, patched core-attention modules treat their input as `pack`."""
    token = _CURRENT.set(pack)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def flash_available(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and tensor.dtype in (torch.bfloat16, torch.float16)


def varlen_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: Packing, scale: float
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]; causal within each row of `pack`."""
    if flash_available(q):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(
            q, k, v, pack.cu_seqlens, pack.cu_seqlens, pack.max_len, pack.max_len,
            scale=scale, window_size=(-1, 0),
        )  # fmt: skip
    return _grouped_sdpa(q, k, v, pack, scale)


def _grouped_sdpa(q, k, v, pack: Packing, scale: float) -> torch.Tensor:
    """Exact fallback: rows of equal length are stacked into one batched causal SDPA call."""
    out = torch.empty_like(q)
    starts = [0]
    for n in pack.lengths[:-1]:
        starts.append(starts[-1] + n)
    by_length: dict[int, list[int]] = {}
    for start, n in zip(starts, pack.lengths):
        by_length.setdefault(n, []).append(start)
    gqa = q.shape[1] != k.shape[1]
    for n, row_starts in by_length.items():
        starts_t = torch.tensor(row_starts, device=q.device)
        index = (starts_t[:, None] + torch.arange(n, device=q.device)).flatten()
        shape = (len(row_starts), n)
        o = F.scaled_dot_product_attention(
            _rows(q, index, shape), _rows(k, index, shape), _rows(v, index, shape),
            is_causal=True, scale=scale, enable_gqa=gqa,
        )  # fmt: skip
        out.index_copy_(0, index, o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2]))
    return out


def _rows(x: torch.Tensor, index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Packed [T, H, D] -> [rows, H, n, D] for the rows whose tokens `index` lists."""
    return x.index_select(0, index).view(*shape, x.shape[1], x.shape[2]).transpose(1, 2)


def install(language_model) -> None:
    """Give every layer's core attention a packed path (used only inside `packing(...)`).

    `forward` is rebound on these module instances, not on megatron's class; outside a
    `packing` block the original forward runs unchanged. Layers without attention (a hybrid
    model's Mamba and MLP layers: the family hooks its own) are left alone.
    """
    for layer in language_model.decoder.layers:
        core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
        if core is None or getattr(core, "_rlflow_packed", False):
            continue
        original = core.forward
        scale = getattr(core, "softmax_scale", None) or core.hidden_size_per_attention_head**-0.5

        def forward(self, query, key, value, attention_mask, *args, _original=original,
                    _scale=scale, **kwargs):  # fmt: skip
            pack = _CURRENT.get()
            if pack is None:
                return _original(query, key, value, attention_mask, *args, **kwargs)
            # megatron's layout: [T, 1, heads, head_dim] (batch 1: the packed row)
            out = varlen_causal(query[:, 0], key[:, 0], value[:, 0], pack, _scale)
            return out.reshape(out.shape[0], 1, -1)

        core.forward = types.MethodType(forward, core)
        core._rlflow_packed = True
    if getattr(language_model, "position_embedding_type", None) == "rope":
        _install_rope(language_model.rotary_pos_emb)


def _install_rope(rotary) -> None:
    """Plain RoPE numbers the whole sequence 0..T-1; inside `packing`, each row restarts at 0.

    (Qwen2.5-VL's mrope takes explicit per-token positions, so it needs no patch.)
    """
    if getattr(rotary, "_rlflow_packed", False):
        return
    original = rotary.forward

    def forward(self, max_seq_len, *args, _original=original, **kwargs):
        pack = _CURRENT.get()
        if pack is None:
            return _original(max_seq_len, *args, **kwargs)
        emb = _original(pack.max_len, *args, **kwargs)  # [max_len, 1, 1, dim]
        starts = pack.cu_seqlens[:-1].long()
        lengths = torch.tensor(pack.lengths, device=starts.device)
        positions = torch.arange(pack.total, device=starts.device) - starts.repeat_interleave(
            lengths, output_size=pack.total
        )
        return emb[positions.to(emb.device)]

    rotary.forward = types.MethodType(forward, rotary)
    rotary._rlflow_packed = True
