"""The decode step's attention as one Triton kernel: rotary, cache write and split-KV attention.

A decode step's attention used to be ~7 kernels per layer (split the fused QKV, rotate q and k,
two cache writes, reshape q for FlashAttention's varlen call, the call, reshape back), and
FlashAttention's varlen kernel gives each (row, KV head) one thread block that walks the row's
keys in order: late in a GRPO rollout, with few live rows, a few dozen blocks on a 132-SM H200
walk hundreds of keys each, and the kernel is latency-bound (~37 µs a layer at any batch size,
benchmarks/grpo_shaped.md). Here one program per (row, KV head, split):

1. reads the new token's query group and key/value straight from the QKV projection's output
   (megatron's fused layout per query group: [q_1..q_group, k, v] x head_dim), applies the
   optional per-head q/k RMSNorm (Qwen3) and RoPE (non-interleaved halves);
2. attends over its share of the row's cached keys (each row's keys are cut into `splits`
   equal chunks at run time, from the row's own length: graph-safe); the last split also
   takes the new key, from registers, and writes the new key and value into the cache
   (no program reads that slot in this step, so nothing races);
3. with one split, writes the output [rows, heads * head_dim] directly; with several, writes
   each split's normalised output and log-sum-exp, and a second small kernel merges them:
   out = sum_s exp(lse_s - lse) out_s.

The same kernel source runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1: the
tests); the engine's CPU path is the exact torch reference in rlflow/generation/decoder.py.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None

BLOCK_N = 64  # keys per tile
MAX_SPLITS = 16
TARGET_PROGRAMS_PER_SM = 2  # split until rows x KV heads x splits fill every SM about twice


def available(q: torch.Tensor, head_dim: int) -> bool:
    """The fused kernel runs on CUDA tensors in bf16/fp16 with a power-of-two head size."""
    return (
        triton is not None
        and q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


def num_splits(rows: int, kv_heads: int, sms: int) -> int:
    """Splits per row (a power of two): 1 when rows x KV heads already fill the GPU."""
    splits = 1
    while splits < MAX_SPLITS and rows * kv_heads * splits < TARGET_PROGRAMS_PER_SM * sms:
        splits *= 2
    return splits


def attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    *,
    group: int,
    scale: float,
    splits: int = 1,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One decode step's attention for `rows` rows.

    qkv [rows, kv * (group + 2) * D]: the QKV projection of the new tokens (bias included);
    cos/sin [rows, D]; keys/values [>= rows, T, kv, D] (keys stored rotated); lengths [rows]:
    each row's keys including the new one, which is written at slot lengths - 1.
    Returns [rows, kv * group * D] in qkv's dtype.
    """
    rows = qkv.shape[0]
    kv, dim = keys.shape[2], keys.shape[3]
    assert keys.stride(3) == 1 and keys.stride() == values.stride()
    assert qkv.is_contiguous() and qkv.shape[1] == kv * (group + 2) * dim
    out = torch.empty(rows, kv * group * dim, dtype=qkv.dtype, device=qkv.device)
    padded_group = max(16, triton.next_power_of_2(group))
    if splits > 1:
        part = torch.empty(rows, kv, splits, padded_group, dim, dtype=torch.float32,
                           device=qkv.device)  # fmt: skip
        lse = torch.empty(rows, kv, splits, padded_group, dtype=torch.float32, device=qkv.device)
    else:
        part = lse = out  # unused
    has_norm = q_norm is not None
    kernels = _kernels()
    kernels[0][(rows, kv, splits)](
        qkv, cos.contiguous(), sin.contiguous(),
        q_norm if has_norm else qkv, k_norm if has_norm else qkv,
        keys, values, lengths, out, part, lse,
        scale * 1.4426950408889634, eps, qkv.stride(0), keys.stride(0), keys.stride(1),
        GROUP=group, PADDED_GROUP=padded_group, DIM=dim, SPLITS=splits, BLOCK_N=BLOCK_N,
        QK_NORM=has_norm, **_launch(qkv.is_cuda),
    )  # fmt: skip
    if splits > 1:
        kernels[1][(rows, kv)](
            part, lse, out, GROUP=group, PADDED_GROUP=padded_group, DIM=dim, SPLITS=splits,
            **_launch(qkv.is_cuda),
        )  # fmt: skip
    return out


def _launch(cuda: bool) -> dict:
    return {"num_warps": 4, "num_stages": 2} if cuda else {}


@functools.cache
def _kernels():
    """(attend, merge), jitted on first use (under TRITON_INTERPRET=1, Triton's interpreter,
    which runs them on CPU tensors: the tests)."""
    return triton.jit(_attend), triton.jit(_merge)


# ----------------------------------------------------------------------------- kernels


def _attend(
    qkv_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, keys_ptr, values_ptr, lengths_ptr,
    out_ptr, part_ptr, lse_ptr, qk_scale, eps, qkv_row_stride, cache_row_stride,
    cache_token_stride, GROUP: tl.constexpr, PADDED_GROUP: tl.constexpr, DIM: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # row * cache_row_stride can pass 2^31
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_heads = tl.num_programs(1)
    length = tl.load(lengths_ptr + row).to(tl.int32)
    new = length - 1  # the new token's slot; cached keys are 0 .. new - 1
    d = tl.arange(0, DIM)
    g = tl.arange(0, PADDED_GROUP)
    half: tl.constexpr = DIM // 2
    swapped = (d + half) % DIM  # rotate_half: [-x2, x1]
    sign = tl.where(d < half, -1.0, 1.0)
    in_group = g < GROUP

    # 1. the new token: query group, key and value from the fused projection; norm; RoPE
    base = qkv_ptr + row * qkv_row_stride + head * (GROUP + 2) * DIM
    q_at = base + g[:, None] * DIM
    q = tl.load(q_at + d[None, :], mask=in_group[:, None], other=0.0).to(tl.float32)
    q_sw = tl.load(q_at + swapped[None, :], mask=in_group[:, None], other=0.0).to(tl.float32)
    k = tl.load(base + GROUP * DIM + d).to(tl.float32)
    k_sw = tl.load(base + GROUP * DIM + swapped).to(tl.float32)
    v = tl.load(base + (GROUP + 1) * DIM + d)
    if QK_NORM:
        q_rms = 1.0 / tl.sqrt(tl.sum(q * q, axis=1) / DIM + eps)
        k_rms = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) / DIM + eps)
        q_w = tl.load(q_norm_ptr + d).to(tl.float32)
        q_w_sw = tl.load(q_norm_ptr + swapped).to(tl.float32)
        k_w = tl.load(k_norm_ptr + d).to(tl.float32)
        k_w_sw = tl.load(k_norm_ptr + swapped).to(tl.float32)
        q_sw = q_sw * q_rms[:, None] * q_w_sw[None, :]
        q = q * q_rms[:, None] * q_w[None, :]
        k_sw = k_sw * k_rms * k_w_sw
        k = k * k_rms * k_w
    cos = tl.load(cos_ptr + row * DIM + d).to(tl.float32)
    sin = tl.load(sin_ptr + row * DIM + d).to(tl.float32)
    q = (q * cos[None, :] + sign[None, :] * q_sw * sin[None, :]).to(v.dtype)
    k = (k * cos + sign * k_sw * sin).to(v.dtype)  # as stored in the cache

    # 2. this split's share of the cached keys, an online softmax in base 2
    per_split = tl.cdiv(tl.cdiv(new, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    stop = tl.minimum(start + per_split, new)
    row_keys = keys_ptr + row * cache_row_stride + head * DIM
    row_values = values_ptr + row * cache_row_stride + head * DIM
    m_i = tl.full([PADDED_GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([PADDED_GROUP], tl.float32)
    acc = tl.zeros([PADDED_GROUP, DIM], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for first in range(start, stop, BLOCK_N):
        slot = first + n
        valid = slot < stop
        at = slot[:, None] * cache_token_stride + d[None, :]
        kt = tl.load(row_keys + at, mask=valid[:, None], other=0.0)
        vt = tl.load(row_values + at, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kt)) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    if split == SPLITS - 1:  # the new key, from registers; then into the cache
        s_new = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * qk_scale
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v.to(tl.float32)[None, :]
        m_i = m_new
        tl.store(row_keys + new * cache_token_stride + d, k)
        tl.store(row_values + new * cache_token_stride + d, v)

    # 3. the output (one split), or this split's part for the merge
    if SPLITS == 1:
        at = out_ptr + row * (kv_heads * GROUP * DIM) + (head * GROUP + g[:, None]) * DIM
        tl.store(at + d[None, :], (acc / l_i[:, None]).to(v.dtype), mask=in_group[:, None])
    else:
        part = (row * kv_heads + head) * SPLITS + split
        empty = l_i == 0.0
        normalised = acc / tl.where(empty, 1.0, l_i)[:, None]
        tl.store(part_ptr + (part * PADDED_GROUP + g[:, None]) * DIM + d[None, :], normalised)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptr + part * PADDED_GROUP + g, lse)


def _merge(
    part_ptr, lse_ptr, out_ptr, GROUP: tl.constexpr, PADDED_GROUP: tl.constexpr,
    DIM: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kv_heads = tl.num_programs(1)
    s = tl.arange(0, SPLITS)
    g = tl.arange(0, PADDED_GROUP)
    d = tl.arange(0, DIM)
    first = (row * kv_heads + head) * SPLITS
    lse = tl.load(lse_ptr + (first + s[:, None]) * PADDED_GROUP + g[None, :])  # [S, G]
    top = tl.max(lse, axis=0)  # finite: the last split always holds the new key
    weight = tl.exp2(lse - top[None, :])
    total = tl.sum(weight, axis=0)
    at = part_ptr + ((first + s[:, None, None]) * PADDED_GROUP + g[None, :, None]) * DIM
    parts = tl.load(at + d[None, None, :])  # [S, G, D]
    merged = tl.sum(parts * weight[:, :, None], axis=0) / total[:, None]
    target = out_ptr + row * (kv_heads * GROUP * DIM) + (head * GROUP + g[:, None]) * DIM
    tl.store(target + d[None, :], merged.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])
