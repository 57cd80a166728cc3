"""The Megatron engine on a hybrid (Nemotron-H) model on one GPU: CUDA graphs vs eager, parity
with HF, and rollout speed against a roofline that counts the Mamba state bytes and, for the
MoE cut, the expert weights the batch actually touches.

The CPU tests (tests/generation/test_generation_hybrid.py) hold the engine's hybrid path to HF
and to itself in fp32 on the exact kernels, eagerly. On a GPU the decode step is a CUDA graph
per batch bucket, which no CPU test can capture; this script checks it and times it:

1. tiny (`builtin:tiny-nemotron-h` and `builtin:tiny-nemotron-h-moe`, fp32 on the GPU): T=1
   rollouts (3 prompts x 6 samples, 32 tokens) with graphs equal those without, also when rows
   stop mid-generation (retired rows move between graph buckets and give their state slots
   back; in the MoE model every bucket's graph holds the routed experts' static-shape path);
   greedy 64 tokens equal HF's; megatron-core's Triton prefill scan and conv and SSM decode
   steps (the engine's on CUDA) against the reference's.
2. cut (`--layers` layers of a 30B-A3B preset, random weights, bf16; `--cut moe`, the default:
   `nemotron-h-30b-a3b`, whose first 8 layers `MEMEM*EM` are the `nemotron-h-30b-a3b-8l`
   preset: Mamba, MoE (128 squared-ReLU experts of 1856, top-6, a shared expert of 3712) and
   attention; `--cut dense`: `nemotron-h-30b-a3b-dense`, MLPs where the MoE layers are):
   `--prompts` x `--samples` rows of `--prompt-len` random tokens, `--max-new-tokens` each with
   no stop (every row lives the whole rollout), graphs on. Reports prefill and decode time, and
   decode against a roofline: per step the weights the step touches are read once (every dense
   part: Mamba, attention, MLP, routers, shared experts, the output head; and of each MoE
   layer's routed experts those the batch chose that step, counted from the engine's own
   routing record), each row's KV (attention layers, its current length) is read, and each
   row's Mamba state (conv + SSM of every Mamba layer) is read and written; roofline time =
   those bytes / the HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/hybrid_engine_gpu_check.py --out $OUT \
        --compare-reference
    # CPU smoke (both parts shrunk: the tiny models eager, a cut of the tiny MoE model, fp32)
    uv run python benchmarks/hybrid_engine_gpu_check.py --tiny --out /tmp/hybrid-engine

Results and the command as run: benchmarks/hybrid_engine_gpu_check.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
TINY_MODELS = ("tiny-nemotron-h", "tiny-nemotron-h-moe")
_KNOBS = dict(max_batch_size=0, compile_decode=False, share_prompts=True, fp8=False,
              release_cache=False, cache_tokens=0)  # fmt: skip


def tiny_check(work: Path, builtin: str, cpu: bool) -> dict:
    from transformers import AutoTokenizer

    from rlflow.generation.base import SamplingParams
    from rlflow.generation.hf import HFGeneration
    from rlflow.generation.megatron.engine import MegatronGeneration
    from rlflow.model import family
    from rlflow.model.build import load_policy
    from tests.tiny import FP32, SINGLE, greedy, text_prompt

    path = family.by_builtin(builtin).write_tiny(work / builtin, builtin, 0, 8.0)
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = [text_prompt(tokenizer, q, f"text-{i}") for i, q in enumerate(QUESTIONS)]
    rows = [p for p in prompts for _ in range(6)]
    pad = tokenizer.pad_token_id
    graphs = MegatronGeneration(policy, pad, cuda_graphs=not cpu, **_KNOBS)
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
    _triton(False)  # the reference scan, conv and SSM steps, to compare
    try:
        reference = eager.generate(rows, free)
    finally:
        _triton(True)
    return {
        "model": builtin,
        "graphs": not cpu,
        "tokens_equal_triton_vs_reference": [x.token_ids for x in a]
        == [x.token_ids for x in reference],
        "max_logprob_diff_triton_vs_reference": max(
            abs(p - q) for x, y in zip(a, reference) for p, q in zip(x.logprobs, y.logprobs)
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


def _triton(on: bool) -> None:
    """The engine's Mamba layers on megatron-core's Triton ops (on) or the reference (off)."""
    from rlflow.generation.megatron import mamba_state

    mamba_state.TRITON_PREFILL = mamba_state.TRITON_DECODE = on


def cut_check(work: Path, args) -> dict:
    from rlflow.generation.base import Prompt, SamplingParams
    from rlflow.generation.megatron.engine import MegatronGeneration
    from rlflow.generation.megatron.hybrid_decoder import HybridDecoder
    from rlflow.generation.megatron.kv_cache import KVCache
    from rlflow.model.build import load_policy
    from rlflow.model.families.nemotron_h import PRESETS, write_tiny_nemotron_h
    from rlflow.model.media import Media
    from tests.tiny import FP32, SINGLE

    cpu = args.tiny
    preset = {"moe": "nemotron-h-30b-a3b", "dense": "nemotron-h-30b-a3b-dense"}[args.cut]
    if cpu:  # the smoke: the tiny MoE model's sizes (`ME*E-`) stand in for the 30B-A3B widths
        preset = {"moe": "tiny-nemotron-h-moe", "dense": "tiny-nemotron-h"}[args.cut]
    full = PRESETS[preset]
    pattern = full.pattern[: args.layers]
    if "*" not in pattern or "M" not in pattern:
        raise SystemExit(f"--layers {args.layers}: the cut {pattern!r} needs M and * layers")
    sizes = dataclasses.replace(full, layers=len(pattern), pattern=pattern)
    device = "cpu" if cpu else "cuda"
    path = write_tiny_nemotron_h(work / "cut", seed=0, sizes=sizes, device=device)
    dtype = torch.float32 if cpu else torch.bfloat16
    model_cfg = dataclasses.replace(FP32, dtype="float32" if cpu else "bfloat16")
    policy = load_policy(path, model_cfg, SINGLE, trainable=False)
    g = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(args.prompts):
        ids = torch.randint(100, sizes.tokenizer_vocab, (args.prompt_len,), generator=g)
        prompts.append(Prompt(f"p{i}", "", tuple(ids.tolist()), Media()))
    rows = [p for p in prompts for _ in range(args.samples)]
    engine = MegatronGeneration(policy, 0, cuda_graphs=not cpu, **_KNOBS)
    params = SamplingParams(args.max_new_tokens, 1.0, 1.0, 0, 3, (), True)
    engine.generate(rows[: len(rows) // 4], dataclasses.replace(params, max_new_tokens=16))
    reference = {}
    if args.compare_reference and not cpu:  # the reference prefill scan and decode steps
        _triton(False)
        engine.close()  # graphs captured again, on the reference
        engine.generate(rows, params)
        reference = engine.last_timings
        _triton(True)
        engine.close()
    _sync(cpu)
    start = time.perf_counter()
    completions = engine.generate(rows, params)
    _sync(cpu)
    total = time.perf_counter() - start
    t = engine.last_timings
    decoder = engine._decoder
    n = len(rows)
    weights = sum(p.numel() * p.element_size() for p in policy.core.parameters())
    embedding = decoder.embedding.word_embeddings.weight
    weights -= embedding.numel() * embedding.element_size()  # a gather: rows, not the table
    if decoder.output_weight.data_ptr() == embedding.data_ptr():  # tied: the head reads it
        weights += embedding.numel() * embedding.element_size()
    moe = routed_experts_touched(decoder, completions, args.prompt_len)
    weights_touched = weights - moe["routed_bytes_all"] + moe["routed_bytes_touched_per_step"]
    d = decoder.dims
    kv_token = KVCache.bytes_per_token(len(decoder.layers), d.kv_heads, d.head_dim, dtype)
    state_row = HybridDecoder.state_bytes_per_row(decoder, dtype)
    mean_len = args.prompt_len + args.max_new_tokens / 2
    step_bytes = weights_touched + n * (mean_len * kv_token + 2 * state_row)
    name = "cpu" if cpu else torch.cuda.get_device_name()
    bandwidth = None if cpu else 4.8e12 if "H200" in name else 3.35e12
    decode_ms = t["decode_ms_per_step"]
    roofline_ms = None if bandwidth is None else 1e3 * step_bytes / bandwidth
    return {
        "device": name,
        "preset": preset,
        "pattern": pattern,
        "rows": n,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "total_s": total,
        "prefill_s": t["prefill_s"],
        "decode_ms_per_step": decode_ms,
        "prefill_s_reference": reference.get("prefill_s"),
        "decode_ms_per_step_reference": reference.get("decode_ms_per_step"),
        "passes": t["passes"],
        "preempted": t["preempted"],
        "bytes_per_step": {
            "weights_touched": weights_touched,
            "of_which_routed_experts": moe["routed_bytes_touched_per_step"],
            "kv": n * mean_len * kv_token,
            "mamba_state_read_write": 2 * n * state_row,
        },  # fmt: skip
        "weights_all_layers": weights,
        "experts": moe["experts"],
        "mamba_state_bytes_per_row": state_row,
        "roofline_ms_per_step": roofline_ms,
        "percent_of_roofline": None if roofline_ms is None else 100 * roofline_ms / decode_ms,
        "tokens_per_s": n * args.max_new_tokens / total,
    }


def routed_experts_touched(decoder, completions, prompt_len: int) -> dict:
    """Routed expert bytes: of all MoE layers, and those a decode step reads on average (per
    MoE layer, the experts any row chose at that step, from the engine's routing record:
    completion.routing [prompt + generated, stack layers, k]); with every row alive for the
    whole rollout, generated token j went through the model at step j for all rows at once."""
    layers = [(i, w) for i, w in enumerate(decoder.moe_layers) if w is not None]
    if not layers:
        return {"routed_bytes_all": 0, "routed_bytes_touched_per_step": 0, "experts": None}
    per_expert = sum(t[0].numel() * t.element_size() for t in (layers[0][1].fc1, layers[0][1].fc2))
    experts, topk = layers[0][1].router.shape[0], decoder.topk
    steps = min(len(c.token_ids) for c in completions) - 1  # the last token was never fed
    routing = torch.stack([c.routing[prompt_len : prompt_len + steps] for c in completions])
    touched = {}  # MoE layer -> mean distinct experts a step
    for index, _ in layers:
        chosen = routing[:, :, index].long().permute(1, 0, 2).reshape(steps, -1)  # [steps, n*k]
        hit = torch.zeros(steps, experts, dtype=torch.bool).scatter_(1, chosen, True)
        touched[index] = float(hit.sum(1).float().mean())
    rows = len(completions)
    uniform = experts * (1 - (1 - topk / experts) ** rows)  # expected under uniform routing
    return {
        "routed_bytes_all": len(layers) * experts * per_expert,
        "routed_bytes_touched_per_step": sum(touched.values()) * per_expert,
        "experts": {
            "per_layer": experts,
            "topk": topk,
            "bytes_per_expert": per_expert,
            "touched_per_step_by_layer": touched,
            "touched_if_uniform": uniform,
        },
    }


def _sync(cpu: bool) -> None:
    if not cpu:
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="tiny,cut", help="comma-separated: tiny, cut")
    parser.add_argument(
        "--cut",
        choices=("moe", "dense"),
        default="moe",
        help="cut: the 30B-A3B hybrid with its MoE layers, or its dense twin",
    )
    parser.add_argument("--layers", type=int, default=8, help="layers of the 30B-A3B cut")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument(
        "--compare-reference",
        action="store_true",
        help="cut: also time prefill and decode on the reference scan, conv and SSM steps",
    )
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke: eager, fp32, the cut from the tiny presets")  # fmt: skip
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no GPU (use --tiny for the CPU smoke test)")
    if args.tiny:
        args.prompts, args.samples, args.prompt_len, args.max_new_tokens = 2, 3, 24, 16
    args.out.mkdir(parents=True, exist_ok=True)
    from tests.tiny import init_single_rank

    init_single_rank()
    results: dict = {}
    work = Path(tempfile.mkdtemp())
    runs = []
    for part in args.parts.split(","):
        if part == "tiny":
            runs += [(b, functools.partial(tiny_check, work, b, args.tiny)) for b in TINY_MODELS]
        else:
            runs.append((f"cut_{args.cut}", functools.partial(cut_check, work, args)))
    for name, run in runs:
        results[name] = run()
        print(json.dumps({name: results[name]}, indent=1), flush=True)
        (args.out / "hybrid_engine_gpu_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
