"""GPU-only checks of the generation engine's fast paths against their exact references.

The CPU test suite covers the engine through its exact paths (SDPA with masks, fp32). On a GPU
in bf16 the engine takes two other kernels, checked here against those references on random
data, plus the CUDA-graph decode against eager decode on the tiny model:

1. decode attention: the fused Triton kernel (rlflow/generation/megatron/flash_decode.py: rotary, q/k
   norm, paged cache write, split-KV attention at 1, 2, 4 and 16 splits) vs the engine's exact
   path in fp32 (split, rotate, index_copy, gather the blocks, masked SDPA), output and cache;
2. packed prefill attention: FlashAttention varlen (causal) vs grouped per-length SDPA;
3. FP8 matmul (rlflow/generation/megatron/fp8.py): torch._scaled_mm with rowwise scales vs the same
   arithmetic on dequantized operands, and vs the bf16 matmul;
4. the tiny model in fp32 on the GPU: CUDA-graph buckets + row retirement vs eager, T=1 tokens.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/engine_gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def paged(keys: torch.Tensor, values: torch.Tensor):
    """A contiguous cache [rows, T, kv, D] (T a multiple of BLOCK) as the engine's paged one:
    (keys, values [blocks, BLOCK, kv, D], table [rows, T / BLOCK + 1]), each row's blocks at
    shuffled places of the pool, block 0 and the table's last column scratch."""
    from rlflow.generation.megatron.kv_cache import BLOCK

    rows, length = keys.shape[:2]
    per_row = length // BLOCK
    order = torch.randperm(rows * per_row, device=keys.device)
    table = torch.zeros(rows, per_row + 1, dtype=torch.int32, device=keys.device)
    table[:, :per_row] = (order + 1).view(rows, per_row).to(torch.int32)

    def pool(t):
        out = torch.zeros(1 + rows * per_row, BLOCK, *t.shape[2:], dtype=t.dtype, device=t.device)
        out[order + 1] = t.reshape(rows * per_row, BLOCK, *t.shape[2:])
        return out

    return pool(keys), pool(values), table


def decode_attention_check() -> dict:
    import dataclasses

    from rlflow.generation.megatron import flash_decode
    from rlflow.generation.megatron.decoder import Dims, LayerWeights, _reference_attention

    torch.manual_seed(0)
    rows, length, kv, group, dim = 37, 704, 2, 8, 128  # (661 tokens used in the longest row)
    dims = Dims(kv * group, kv, dim, 1e-6, dim**-0.5, None)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    keys, values, table = paged(torch.randn(rows, length, kv, dim, **bf16),
                                torch.randn(rows, length, kv, dim, **bf16))  # fmt: skip
    qkv = torch.randn(rows, kv * (group + 2) * dim, **bf16)
    angles = torch.rand(rows, 1, dim // 2, device="cuda") * 6
    cos = torch.cat((angles, angles), -1).cos().to(torch.bfloat16)
    sin = torch.cat((angles, angles), -1).sin().to(torch.bfloat16)
    lengths = torch.randint(2, 662, (rows,), device="cuda")
    lengths[:3] = torch.tensor([2, 3, 661])  # one cached key, two, the longest row
    out = {}
    for qk_norm in (False, True):
        norms = (torch.rand(dim, **bf16) + 0.5, torch.rand(dim, **bf16) + 0.5)
        w = dataclasses.replace(LayerWeights(*([None] * 12)),
                                **({"q_norm": norms[0], "k_norm": norms[1]} if qk_norm else {}))  # fmt: skip
        w32 = dataclasses.replace(w, q_norm=None if w.q_norm is None else w.q_norm.float(),
                                  k_norm=None if w.k_norm is None else w.k_norm.float())  # fmt: skip
        ref_k, ref_v = keys.float(), values.float()
        ref = _reference_attention(qkv.float(), w32, cos.float(), sin.float(), ref_k, ref_v,
                                   table, lengths, dims)  # fmt: skip
        for splits in (1, 2, 4, 16):
            k, v = keys.clone(), values.clone()
            fast = flash_decode.attention(qkv, cos[:, 0], sin[:, 0], k, v, table, lengths,
                                          group=group,
                                          scale=dims.scale, splits=splits, q_norm=w.q_norm,
                                          k_norm=w.k_norm, eps=dims.eps)  # fmt: skip
            tag = f"{'qknorm_' if qk_norm else ''}splits_{splits}"
            out[f"max_abs_diff_{tag}"] = float((fast.float() - ref).abs().max())
            out[f"cache_max_abs_diff_{tag}"] = float((k.float() - ref_k).abs().max())
    out["ref_scale"] = float(ref.abs().max())
    out["max_abs_diff"] = max(v for k, v in out.items() if k.startswith("max_abs_diff_"))
    out["cache_max_abs_diff"] = max(v for k, v in out.items() if k.startswith("cache_max"))
    out["timing_us"] = decode_attention_timing()
    return out


def decode_attention_timing() -> dict:
    """Median µs per layer call: the fused kernel at its chosen splits vs FlashAttention
    varlen (torch's bundled FA2, the engine's previous decode kernel; attention only)."""
    shapes = ((512, 300), (64, 1200), (16, 2500), (4, 4000))
    return {f"rows{rows}_ctx{context}": _time_decode(rows, context) for rows, context in shapes}


def _time_decode(rows: int, context: int) -> dict:
    from triton.testing import do_bench

    from rlflow.generation.megatron import flash_decode

    kv, group, dim, length = 2, 8, 128, 4608
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(rows, length, kv, dim, **bf16)
    values = torch.randn_like(keys)
    pool_k, pool_v, table = paged(keys, values)
    qkv = torch.randn(rows, kv * (group + 2) * dim, **bf16)
    cos, sin = torch.ones(rows, dim, **bf16), torch.zeros(rows, dim, **bf16)
    lengths = torch.full((rows,), context, device="cuda")
    splits = flash_decode.num_splits(rows, kv, sms)

    def fused():
        flash_decode.attention(qkv, cos, sin, pool_k, pool_v, table, lengths, group=group,
                               scale=dim**-0.5, splits=splits)  # fmt: skip

    q = torch.randn(rows * group, kv, dim, **bf16)
    cu_q = torch.arange(rows + 1, device="cuda", dtype=torch.int32) * group
    cu_k = torch.arange(rows + 1, device="cuda", dtype=torch.int32) * length
    used = lengths.to(torch.int32)
    flat_k, flat_v = keys.view(-1, kv, dim), values.view(-1, kv, dim)

    def fa2():
        torch.ops.aten._flash_attention_forward(q, flat_k, flat_v, cu_q, cu_k, group, length, 0.0,
                                                False, False, scale=dim**-0.5, seqused_k=used)  # fmt: skip

    fused_ms = do_bench(fused, return_mode="median")
    fa2_ms = do_bench(fa2, return_mode="median")
    read = rows * context * kv * dim * 2 * 2  # K and V bytes
    return {"splits": splits, "fused_us": fused_ms * 1e3, "fa2_us": fa2_ms * 1e3,
            "fused_tb_s": read / fused_ms / 1e9, "fa2_tb_s": read / fa2_ms / 1e9}  # fmt: skip


def fp8_matmul_check() -> dict:
    from rlflow.generation.megatron import fp8

    torch.manual_seed(2)
    out = {}
    for m, n, k in ((64, 2560, 2048), (512, 22016, 2048), (3, 2048, 11008)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = fp8.quantize_weight(weight)
        fast = fp8.linear(x, q).float()
        ref = fp8.reference_linear(x.float(), q).float()
        exact = x.float() @ weight.float().T
        out[f"{m}x{n}x{k}"] = {
            "rel_vs_reference": float((fast - ref).norm() / ref.norm()),
            "rel_vs_bf16_matmul": float((fast - exact).norm() / exact.norm()),
        }
    return out


def prefill_attention_check() -> dict:
    from rlflow.model.packed_attention import Packing, varlen_causal

    torch.manual_seed(1)
    lengths = [5, 130, 17, 130, 64, 1, 250]
    pack = Packing.of(lengths, "cuda")
    q = torch.randn(pack.total, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(pack.total, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fast = varlen_causal(q, k, v, pack, 128**-0.5)
    ref = varlen_causal(q.float(), k.float(), v.float(), pack, 128**-0.5)
    return {
        "max_abs_diff": float((fast.float() - ref).abs().max()),
        "ref_scale": float(ref.abs().max()),
    }


def tiny_engine_check(work: Path) -> dict:
    from rlflow.generation.base import SamplingParams
    from rlflow.generation.megatron.engine import MegatronGeneration
    from rlflow.model.build import load_policy
    from tests.tiny import FP32, SINGLE, init_single_rank, mixed_prompts, tiny_checkpoint

    init_single_rank()
    ckpt = tiny_checkpoint(str(work))
    policy = load_policy(ckpt, FP32, SINGLE, trainable=False)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(ckpt))
    rows = [p for p in mixed_prompts(processor) for _ in range(6)]
    pad = processor.tokenizer.pad_token_id
    free = SamplingParams(32, 1.0, 1.0, 0, 5, (-1,), True)
    knobs = dict(max_batch_size=0, compile_decode=False, share_prompts=True, fp8=False,
                 release_cache=False, cache_tokens=0)  # fmt: skip
    graphs = MegatronGeneration(policy, pad, cuda_graphs=True, **knobs)
    eager = MegatronGeneration(policy, pad, cuda_graphs=False, **knobs)
    a, b = graphs.generate(rows, free), eager.generate(rows, free)
    # stop on a token some rows emit: retirement moves rows between graph buckets
    counts: dict[int, int] = {}
    for c in a:
        for t in set(c.token_ids[:16]):
            counts[t] = counts.get(t, 0) + 1
    stop = max((t for t, n in counts.items() if n < len(rows) // 2), key=lambda t: counts[t])
    stopping = SamplingParams(32, 1.0, 1.0, 0, 5, (stop,), False)
    c, d = graphs.generate(rows, stopping), eager.generate(rows, stopping)
    return {
        "rows": len(rows),
        "tokens_equal_free": [x.token_ids for x in a] == [x.token_ids for x in b],
        "tokens_equal_with_retirement": [x.token_ids for x in c] == [x.token_ids for x in d],
        "rows_stopped": sum(x.finish_reason == "stop" for x in c),
        "max_logprob_diff": max(
            abs(p - q) for x, y in zip(c, d) for p, q in zip(x.logprobs, y.logprobs)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kernels-only", action="store_true", help="skip the tiny-model check")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "decode_attention": decode_attention_check(),
        "prefill_attention": prefill_attention_check(),
        "fp8_matmul": fp8_matmul_check(),
    }
    print(json.dumps(results), flush=True)
    if not args.kernels_only:
        results["tiny_engine"] = tiny_engine_check(Path(tempfile.mkdtemp()))
    print(json.dumps(results, indent=1), flush=True)
    (args.out / "engine_gpu_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
