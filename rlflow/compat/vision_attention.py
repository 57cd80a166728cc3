"""One attention call per group of equal-length windows in Qwen2.5-VL's vision tower.

HF's vision attention without flash-attn loops in Python over every window of every image
(64 images x 4 windows x 28 windowed layers = ~7k SDPA calls for a 64-image batch): that loop,
not the FLOPs, dominates time to first token. Windows of equal length are independent sequences
of the same shape, so they stack into one batched SDPA call; a batch of same-size images has
one or two distinct lengths per layer. The math is HF's (same rotary, same scaling), only batched.

`install(visual)` rebinds `forward` on this model's attention modules only (not the HF class).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def install(visual) -> None:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    for block in visual.blocks:
        block.attn.forward = types.MethodType(
            _make_forward(apply_rotary_pos_emb_vision), block.attn
        )


def _make_forward(apply_rotary):
    def forward(
        self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs
    ):
        length = hidden_states.shape[0]
        q, k, v = (
            self.qkv(hidden_states)
            .reshape(length, 3, self.num_heads, -1)
            .permute(1, 0, 2, 3)
            .unbind(0)
        )
        cos, sin = position_embeddings
        q, k = apply_rotary(q, k, cos, sin)
        out = windowed_attention(q, k, v, cu_seqlens, self.scaling)
        return self.proj(out.reshape(length, -1))

    return forward


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention within each [cu_seqlens[i], cu_seqlens[i+1]) segment; q, k, v: [S, heads, D]."""
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    starts = [a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if len(set(lengths)) == 1 and starts[0] == 0 and sum(lengths) == q.shape[0]:
        # The common case (same-size images, contiguous windows): a view, no gather.
        def view(t):
            return t.view(len(lengths), lengths[0], *t.shape[1:]).transpose(1, 2)

        attended = F.scaled_dot_product_attention(view(q), view(k), view(v), scale=scale)
        return attended.transpose(1, 2).reshape(q.shape)
    out = torch.empty_like(q)
    by_length: dict[int, list[int]] = {}
    for start, n in zip(starts, lengths):
        by_length.setdefault(n, []).append(start)
    for n, group in by_length.items():
        index = (
            torch.tensor(group, device=q.device)[:, None] + torch.arange(n, device=q.device)[None]
        ).reshape(-1)
        picked = [
            t.index_select(0, index).view(len(group), n, *t.shape[1:]).transpose(1, 2)
            for t in (q, k, v)
        ]
        attended = F.scaled_dot_product_attention(*picked, scale=scale)
        out.index_copy_(0, index, attended.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out
