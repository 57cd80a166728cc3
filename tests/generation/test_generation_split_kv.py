"""Split-KV decode attention (rlflow/generation/split_kv.py) splits and merges exactly.

The GPU kernel it wraps (FlashAttention varlen) does not run on CPU, so `attend` here is an
exact fp32 stand-in with FlashAttention's contract: the same cu_seqlens / seqused_k reading, a
zero output and an lse of +inf for a sequence with no keys, and either lse layout. The real
kernel is checked against masked SDPA on the GPU by benchmarks/engine_gpu_check.py.
"""

from __future__ import annotations

import pytest
import torch

from rlflow.generation import split_kv
from rlflow.generation.decoder import Dims, _decode_attention


def reference_attend(padded_lse: bool, scale: float):
    def attend(q, k, v, cu_q, cu_k, max_q, max_k, used):
        sequences, kv = used.shape[0], q.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full((kv, q.shape[0]), float("inf"))
        for b in range(sequences):
            n = int(used[b])
            assert n <= max_k
            if n == 0:
                continue
            qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
            keys = k[int(cu_k[b]) : int(cu_k[b]) + n]  # [n, kv, D]
            values = v[int(cu_k[b]) : int(cu_k[b]) + n]
            scores = torch.einsum("qhd,khd->hqk", q[qs], keys) * scale
            lse[:, qs] = torch.logsumexp(scores, dim=-1)
            out[qs] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values)
        if padded_lse:  # [sequences, kv, max_q], as some FlashAttention builds return it
            lse = lse.view(kv, sequences, max_q).permute(1, 0, 2)
        return out, lse

    return attend


@pytest.mark.parametrize("padded_lse", [False, True])
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_kv_attention_equals_unsplit_attention(splits, padded_lse):
    torch.manual_seed(splits)
    rows, length, kv, group, dim = 7, 300, 2, 4, 16
    dims = Dims(kv * group, kv, dim, 1e-6, dim**-0.5, None)
    keys = torch.randn(rows, length, kv, dim)
    values = torch.randn_like(keys)
    q = torch.randn(rows, kv * group, dim)
    # a row with one key, rows that end inside the first, a middle and the last chunk, a full row
    lengths = torch.tensor([1, 2, 59, 150, 151, 299, 300])
    flat_k, flat_v = keys.view(-1, kv, dim), values.view(-1, kv, dim)
    exact = _decode_attention(q, keys, values, flat_k, flat_v, lengths, dims)  # masked SDPA

    plan = split_kv.plan(lengths, length, group, splits)
    assert plan.used.view(rows, splits).sum(1).tolist() == lengths.tolist()
    q_tokens = q.view(rows, kv, group, dim).transpose(1, 2).reshape(rows * group, kv, dim)
    out = split_kv.attention(
        q_tokens, flat_k, flat_v, plan, rows, reference_attend(padded_lse, dims.scale)
    )
    out = out.view(rows, group, kv, dim).transpose(1, 2).reshape(rows, -1)
    torch.testing.assert_close(out, exact, atol=1e-5, rtol=1e-5)


def test_splits_only_when_rows_do_not_fill_the_gpu():
    sms = 132
    assert split_kv.num_splits(512, 2, 661, sms) == 1  # 1,024 blocks: already two waves
    assert split_kv.num_splits(32, 2, 661, sms) == 5  # 64 blocks: capped by 661 // 128 keys
    assert split_kv.num_splits(100, 2, 661, sms) == 2
    assert split_kv.num_splits(8, 2, 200, sms) == 1  # too few keys to be worth a split
