"""The Megatron engine on a hybrid (Nemotron-H) model on one GPU: CUDA graphs vs eager, parity
with HF, and rollout speed against a roofline that counts the Mamba state bytes.

The CPU tests (tests/generation/test_generation_hybrid.py) hold the engine's hybrid path to HF
and to itself in fp32 on the exact kernels, eagerly. On a GPU the decode step is a CUDA graph
per batch bucket, which no CPU test can capture; this script checks it and times it:

1. tiny (`builtin:tiny-nemotron-h`, fp32 on the GPU): T=1 rollouts (3 prompts x 6 samples, 32
   tokens) with graphs equal those without, also when rows stop mid-generation (retired rows
   move between graph buckets and give their state slots back); greedy 64 tokens equal HF's;
   megatron-core's Triton SSM decode step (the engine's on CUDA) against the reference's.
2. cut (`--layers` layers of the `nemotron-h-30b-a3b-dense` preset: the 30B-A3B widths, Mamba /
   MLP / attention in its order, random weights, bf16): `--prompts` x `--samples` rows of
   `--prompt-len` random tokens, `--max-new-tokens` each with no stop (every row lives the
   whole rollout), graphs on. Reports prefill and decode time, and decode against a roofline:
   per step the weights (all layers + the output head) are read once, each row's KV (attention
   layers, its current length) is read, and each row's Mamba state (conv + SSM of every Mamba
   layer) is read and written; roofline time = those bytes / the HBM bandwidth (H100 SXM
   3.35 TB/s, H200 4.8 TB/s).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/hybrid_engine_gpu_check.py --out $OUT \
        --compare-reference

Results and the command as run: benchmarks/hybrid_engine_gpu_check.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTIONS = [
    "How many red squares are there?",
    "Count.",
    "A picture shows a large blue triangle and a small red circle. How many circles?",
]
_KNOBS = dict(max_batch_size=0, compile_decode=False, share_prompts=True, fp8=False,
              release_cache=False, cache_tokens=0)  # fmt: skip


def tiny_check(work: Path) -> dict:
    from transformers import AutoTokenizer

    from rlflow.generation.base import SamplingParams
    from rlflow.generation.hf import HFGeneration
    from rlflow.generation.megatron import mamba_state
    from rlflow.generation.megatron.engine import MegatronGeneration
    from rlflow.model import family
    from rlflow.model.build import load_policy
    from tests.tiny import FP32, SINGLE, greedy, text_prompt

    path = family.by_builtin("tiny-nemotron-h").write_tiny(work, "tiny-nemotron-h", 0, 8.0)
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = [text_prompt(tokenizer, q, f"text-{i}") for i, q in enumerate(QUESTIONS)]
    rows = [p for p in prompts for _ in range(6)]
    pad = tokenizer.pad_token_id
    graphs = MegatronGeneration(policy, pad, cuda_graphs=True, **_KNOBS)
    eager = MegatronGeneration(policy, pad, cuda_graphs=False, **_KNOBS)
    free = SamplingParams(32, 1.0, 1.0, 0, 5, (-1,), True)
    a, b = graphs.generate(rows, free), eager.generate(rows, free)
    counts: dict[int, int] = {}
    for c in a:
        for t in set(c.token_ids[:16]):
            counts[t] = counts.get(t, 0) + 1
    stop = max((t for t, n in counts.items() if n < len(rows) // 2), key=lambda t: counts[t])
    stopping = SamplingParams(32, 1.0, 1.0, 0, 5, (stop,), False)
    c, d = graphs.generate(rows, stopping), eager.generate(rows, stopping)
    params = greedy(64, tokenizer.eos_token_id)
    ours = graphs.generate(prompts, params)
    ref = HFGeneration(policy, pad, 8).generate(prompts, params)
    mamba_state.TRITON_SSM_DECODE = False  # the reference SSM step, for comparison
    try:
        reference_ssm = eager.generate(rows, free)
    finally:
        mamba_state.TRITON_SSM_DECODE = True
    return {
        "tokens_equal_triton_vs_reference_ssm": [x.token_ids for x in a]
        == [x.token_ids for x in reference_ssm],
        "max_logprob_diff_triton_vs_reference_ssm": max(
            abs(p - q) for x, y in zip(a, reference_ssm) for p, q in zip(x.logprobs, y.logprobs)
        ),
        "rows": len(rows),
        "graphs_captured": sorted(graphs._graphs),
        "tokens_equal_free": [x.token_ids for x in a] == [x.token_ids for x in b],
        "tokens_equal_with_retirement": [x.token_ids for x in c] == [x.token_ids for x in d],
        "rows_stopped": sum(x.finish_reason == "stop" for x in c),
        "max_logprob_diff_graphs_vs_eager": max(
            abs(p - q) for x, y in zip(c, d) for p, q in zip(x.logprobs, y.logprobs)
        ),
        "greedy_64_equal_hf": [x.token_ids for x in ours] == [x.token_ids for x in ref],
        "max_logprob_diff_vs_hf": max(
            abs(p - q) for x, y in zip(ours, ref) for p, q in zip(x.logprobs, y.logprobs)
        ),
    }


def cut_check(work: Path, args) -> dict:
    from rlflow.generation.base import Prompt, SamplingParams
    from rlflow.generation.megatron import mamba_state
    from rlflow.generation.megatron.engine import MegatronGeneration
    from rlflow.generation.megatron.hybrid_decoder import HybridDecoder
    from rlflow.generation.megatron.kv_cache import KVCache
    from rlflow.model.build import load_policy
    from rlflow.model.families.nemotron_h import PRESETS, write_tiny_nemotron_h
    from rlflow.model.media import Media
    from tests.tiny import FP32, SINGLE

    full = PRESETS["nemotron-h-30b-a3b-dense"]
    pattern = full.pattern[: args.layers]
    if "*" not in pattern or "M" not in pattern:
        raise SystemExit(f"--layers {args.layers}: the cut {pattern!r} needs M and * layers")
    sizes = dataclasses.replace(full, layers=args.layers, pattern=pattern)
    path = write_tiny_nemotron_h(work / "cut", seed=0, sizes=sizes, device="cuda")
    bf16 = dataclasses.replace(FP32, dtype="bfloat16")
    policy = load_policy(path, bf16, SINGLE, trainable=False)
    g = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(args.prompts):
        ids = torch.randint(100, sizes.tokenizer_vocab, (args.prompt_len,), generator=g)
        prompts.append(Prompt(f"p{i}", "", tuple(ids.tolist()), Media()))
    rows = [p for p in prompts for _ in range(args.samples)]
    engine = MegatronGeneration(policy, 0, cuda_graphs=True, **_KNOBS)
    params = SamplingParams(args.max_new_tokens, 1.0, 1.0, 0, 3, (), True)
    engine.generate(rows[: len(rows) // 4], dataclasses.replace(params, max_new_tokens=16))
    reference_ms = None
    if args.compare_reference:  # the reference SSM decode step (gather, update, scatter)
        mamba_state.TRITON_SSM_DECODE = False
        engine.close()  # graphs captured again, on the reference
        engine.generate(rows, params)
        reference_ms = engine.last_timings["decode_ms_per_step"]
        mamba_state.TRITON_SSM_DECODE = True
        engine.close()
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(rows, params)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    t = engine.last_timings
    decoder = engine._decoder
    n = len(rows)
    weights = sum(p.numel() * p.element_size() for p in policy.core.parameters())
    embedding = decoder.embedding.word_embeddings.weight
    weights -= embedding.numel() * embedding.element_size()  # a gather: rows, not the table
    if decoder.output_weight.data_ptr() == embedding.data_ptr():  # tied: the head reads it
        weights += embedding.numel() * embedding.element_size()
    d = decoder.dims
    kv_token = KVCache.bytes_per_token(len(decoder.layers), d.kv_heads, d.head_dim, torch.bfloat16)
    state_row = HybridDecoder.state_bytes_per_row(decoder, torch.bfloat16)
    mean_len = args.prompt_len + args.max_new_tokens / 2
    step_bytes = weights + n * (mean_len * kv_token + 2 * state_row)
    name = torch.cuda.get_device_name()
    bandwidth = 4.8e12 if "H200" in name else 3.35e12
    decode_ms = t["decode_ms_per_step"]
    roofline_ms = 1e3 * step_bytes / bandwidth
    return {
        "device": name,
        "pattern": pattern,
        "rows": n,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "total_s": total,
        "prefill_s": t["prefill_s"],
        "decode_ms_per_step": decode_ms,
        "decode_ms_per_step_reference_ssm": reference_ms,
        "passes": t["passes"],
        "preempted": t["preempted"],
        "bytes_per_step": {
            "weights": weights,
            "kv": n * mean_len * kv_token,
            "mamba_state_read_write": 2 * n * state_row,
        },  # fmt: skip
        "mamba_state_bytes_per_row": state_row,
        "roofline_ms_per_step": roofline_ms,
        "percent_of_roofline": 100 * roofline_ms / decode_ms,
        "tokens_per_s": n * args.max_new_tokens / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="tiny,cut", help="comma-separated: tiny, cut")
    parser.add_argument("--layers", type=int, default=8, help="layers of the 30B-A3B cut")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--compare-reference", action="store_true",
                        help="cut: also time decode with the reference SSM step")  # fmt: skip
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from tests.tiny import init_single_rank

    init_single_rank()
    results: dict = {}
    work = Path(tempfile.mkdtemp())
    for part in args.parts.split(","):
        results[part] = tiny_check(work) if part == "tiny" else cut_check(work, args)
        print(json.dumps({part: results[part]}, indent=1), flush=True)
        (args.out / "hybrid_engine_gpu_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
