"""The Triton kernels of rlflow/generation/megatron/flash_decode.py (the launcher, which explains them).

Kept apart so that nothing imports Triton until a decode step on a CUDA tensor needs it: the
launcher imports this module on first use, and a CPU machine (the test suite, a CPU-only torch
without Triton) never does. `@triton.jit` compiles at the first launch, for the device it sees;
under TRITON_INTERPRET=1 (set before this import) the same source runs on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend(
    qkv_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, keys_ptr, values_ptr, table_ptr,
    lengths_ptr, out_ptr, part_ptr, lse_ptr, qk_scale, eps, qkv_row_stride, table_row_stride,
    cache_block_stride, cache_token_stride, GROUP: tl.constexpr, PADDED_GROUP: tl.constexpr, DIM: tl.constexpr,
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
    row_table = table_ptr + row * table_row_stride  # the row's blocks (BLOCK_N tokens each)
    head_keys = keys_ptr + head * DIM
    head_values = values_ptr + head * DIM
    m_i = tl.full([PADDED_GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([PADDED_GROUP], tl.float32)
    acc = tl.zeros([PADDED_GROUP, DIM], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for first in range(start, stop, BLOCK_N):  # one tile = one block (first is a multiple)
        valid = first + n < stop
        block = tl.load(row_table + first // BLOCK_N).to(tl.int64)
        at = block * cache_block_stride + n[:, None] * cache_token_stride + d[None, :]
        kt = tl.load(head_keys + at, mask=valid[:, None], other=0.0)
        vt = tl.load(head_values + at, mask=valid[:, None], other=0.0)
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
        block = tl.load(row_table + new // BLOCK_N).to(tl.int64)
        at = block * cache_block_stride + (new % BLOCK_N) * cache_token_stride + d
        tl.store(head_keys + at, k)
        tl.store(head_values + at, v)

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


@triton.jit
def merge(
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
