"""Split-KV decode attention ("flash decoding") on top of FlashAttention's varlen kernel.

FlashAttention gives each (row, KV head) one thread block, which walks that row's keys in
order. A decode step late in a GRPO rollout has few live rows, each with a long context: a
few dozen blocks on a 132-SM H200, each walking hundreds of keys one tile after another, so the
kernel takes ~37 µs a layer whether 32 or 512 rows are live. Split-KV cuts each row's keys into
`splits` chunks that run as separate varlen "sequences" (one block each) and merges the partial
results by their log-sum-exp, exactly:

    out = sum_s exp(lse_s - lse) * out_s,   lse = log sum_s exp(lse_s)

The plan (chunk starts and used lengths) is built once per decode step and shared by every
layer; `attend` is the kernel call, so the CPU tests run the same split and merge against an
exact reference kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Enough blocks to fill every SM about twice; a chunk is at least this many keys.
BLOCKS_PER_SM = 2
MIN_CHUNK = 128


@dataclass(frozen=True)
class SplitPlan:
    splits: int
    chunk: int  # keys per chunk (the last one may be shorter or empty)
    cu_q: torch.Tensor  # [rows * splits + 1] int32: `group` query tokens per chunk
    cu_k: torch.Tensor  # [rows * splits + 1] int32: chunk starts in the flat cache
    used: torch.Tensor  # [rows * splits] int32: keys of each chunk a row really has
    merge: Callable | None = (
        None  # `merge` below, or its torch.compile'd form (the decoder's choice)
    )


def num_splits(rows: int, kv_heads: int, length: int, sms: int) -> int:
    """How many chunks per row: 1 when rows x KV heads already fill the GPU."""
    blocks = rows * kv_heads
    wanted = -(-BLOCKS_PER_SM * sms // blocks)
    return max(1, min(wanted, length // MIN_CHUNK))


def plan(lengths: torch.Tensor, length: int, group: int, splits: int) -> SplitPlan:
    """lengths [rows]: each row's key count; length: the cache's keys per row."""
    rows, device = lengths.shape[0], lengths.device
    chunk = -(-length // splits)
    starts = torch.arange(splits, device=device, dtype=torch.int32) * chunk  # [S]
    row_base = torch.arange(rows, device=device, dtype=torch.int32)[:, None] * length
    cu_k = torch.cat((
        (row_base + starts[None]).reshape(-1),
        torch.full((1,), rows * length, device=device, dtype=torch.int32),
    ))  # fmt: skip
    used = (lengths.to(torch.int32)[:, None] - starts[None]).clamp(0, chunk).reshape(-1)
    cu_q = torch.arange(rows * splits + 1, device=device, dtype=torch.int32) * group
    return SplitPlan(splits, chunk, cu_q, cu_k, used)


def attention(q_tokens, flat_keys, flat_values, split: SplitPlan, rows: int, attend):
    """q_tokens [rows * group, kv, D] (a row's query heads as `group` tokens per KV head) ->
    [rows * group, kv, D], attending over each row's keys in `split.splits` chunks.

    attend(q, k, v, cu_q, cu_k, max_q, max_k, used) -> (out [Nq, kv, D], lse): FlashAttention
    varlen's contract, lse either [kv, Nq] or [sequences, kv, max_q]."""
    s, kv, dim = split.splits, q_tokens.shape[1], q_tokens.shape[2]
    group = q_tokens.shape[0] // rows
    q = q_tokens.view(rows, 1, group, kv, dim).expand(rows, s, group, kv, dim)
    q = q.reshape(rows * s * group, kv, dim)
    out, lse = attend(
        q, flat_keys, flat_values, split.cu_q, split.cu_k, group, split.chunk, split.used
    )
    if lse.dim() == 2:  # [kv, rows * S * group]
        lse = lse.view(kv, rows, s, group).permute(1, 2, 3, 0)
    else:  # [rows * S, kv, group]
        lse = lse.view(rows, s, kv, group).transpose(2, 3)
    merge_fn = split.merge or merge
    return merge_fn(out.view(rows, s, group, kv, dim), lse, split.used.view(rows, s))


def merge(out: torch.Tensor, lse: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """out [rows, S, group, kv, D], lse [rows, S, group, kv], used [rows, S] -> [rows*group, kv, D].

    An empty chunk's output and lse are meaningless (FlashAttention writes 0 and +inf there): it
    gets weight 0.
    Chunk 0 always has the row's first key, so every row keeps a finite weight."""
    dtype = out.dtype
    has_keys = used[:, :, None, None] > 0
    lse = torch.where(has_keys, lse.float(), float("-inf"))
    weights = torch.softmax(lse, dim=1)[..., None]  # over the chunks
    out = torch.where(has_keys[..., None], out.float(), 0.0)  # never 0 * (whatever it wrote)
    merged = (out * weights).sum(dim=1)
    return merged.to(dtype).reshape(-1, out.shape[3], out.shape[4])
