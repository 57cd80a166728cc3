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
2. attends over its share of the row's cached keys, block by block through the row's block
   table (each row's keys are cut into `splits` equal chunks of whole blocks at run time, from
   the row's own length: graph-safe); the last split also
   takes the new key, from registers, and writes the new key and value into the cache
   (no program reads that slot in this step, so nothing races);
3. with one split, writes the output [rows, heads * head_dim] directly; with several, writes
   each split's normalised output and log-sum-exp, and a second small kernel merges them:
   out = sum_s exp(lse_s - lse) out_s.

The same kernel source runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1: the
tests); the engine's CPU path is the exact torch reference in rlflow/generation/megatron/decoder.py.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from rlflow.generation.megatron.kv_cache import BLOCK

BLOCK_N = (
    BLOCK  # keys per tile: one block of the paged cache (rlflow/generation/megatron/kv_cache.py)
)
MAX_SPLITS = 16
TARGET_PROGRAMS_PER_SM = 2  # split until rows x KV heads x splits fill every SM about twice


def available(q: torch.Tensor, head_dim: int) -> bool:
    """The fused kernel runs on CUDA tensors in bf16/fp16 with a power-of-two head size."""
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and _triton_installed()
    )


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


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
    table: torch.Tensor,
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
    cos/sin [rows, D]; keys/values: the block pools [blocks, BLOCK_N, kv, D] (keys stored
    rotated); table [>= rows, max_blocks] int32: row r's token j is in block table[r, j //
    BLOCK_N] (rlflow/generation/megatron/kv_cache.py); lengths [rows]: each row's keys including the
    new one, which is written at token lengths - 1. Returns [rows, kv * group * D] in qkv's
    dtype.
    """
    rows = qkv.shape[0]
    kv, dim = keys.shape[2], keys.shape[3]
    assert keys.shape[1] == BLOCK_N, "a cache block must be one key tile"
    assert keys.stride(3) == 1 and keys.stride() == values.stride()
    assert table.dtype == torch.int32 and table.stride(1) == 1
    assert qkv.is_contiguous() and qkv.shape[1] == kv * (group + 2) * dim
    out = torch.empty(rows, kv * group * dim, dtype=qkv.dtype, device=qkv.device)
    padded_group = max(16, 1 << (group - 1).bit_length())  # a power of two, >= 16
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
        keys, values, table, lengths, out, part, lse,
        scale * 1.4426950408889634, eps, qkv.stride(0), table.stride(0), keys.stride(0),
        keys.stride(1),
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


def _kernels():
    """(attend, merge) from flash_decode_kernels.py, imported on first use only: the one place
    rlflow imports Triton (under TRITON_INTERPRET=1 its interpreter runs them on CPU tensors:
    the tests)."""
    from rlflow.generation.megatron import flash_decode_kernels

    return flash_decode_kernels.attend, flash_decode_kernels.merge
