"""GRPO-shaped MoE rollouts and whole GRPO steps on a Qwen3-30B-A3B-shaped model (issue 18, item 8).

Model: text-only Qwen3-MoE with Qwen3-30B-A3B's shapes (hidden 2048, 32 query / 4 KV heads of
128, 128 experts of 768, top-8, vocab 151936), random weights, bf16, cut to --layers decoder
layers (default 6). Why 6: one H200 holds the policy, the reference and the optimizer at about
20 bytes per parameter (bf16 weights 2 + fp32 main weights 4 + Adam moments 8 + fp32 gradient
buffer 4 for the policy, bf16 reference 2): 6 layers are 4.4 B parameters (3.7 B in experts,
0.6 B embedding and head), 87 GB, which leaves ~50 GB of the 141 GB for the KV cache of 512 rows,
the update's activations and logits; 8 layers (5.6 B, 112 GB) would leave too little. The
Qwen3-VL-30B-A3B language model has the same shapes (the vision tower adds 0.4 B parameters).

Workload (as benchmarks/grpo_shaped.py, text prompts): 64 prompts x 8 samples = 512 rollouts,
ragged questions of 10-120 tokens in the chat template, T=1 sampling, cap 256 new tokens, a
seeded stop set of vocab/80 ids (random weights never emit EOS).

Parts (--parts):
- experts: one MoE layer's experts at the full shape (128 x 768, top-8), forward + backward at
           512, 4096 and 16384 tokens: rlflow's grouped experts (two torch._grouped_mm) against
           megatron-core's SequentialMLP (one matmul pair per expert, host sync), same weights;
           also the engine's routed-experts decode step at 64 and 512 rows.
- rollout: MegatronGeneration.generate on the 512 rollouts (CUDA graphs), warm-up then the
           median of --reps calls: useful tokens/s, % of the MoE roofline below, peak memory.
- step:    whole GRPO steps (rlflow.train.setup + loop.grpo_step) with router replay: seconds
           per phase, tokens/s/GPU, update and logprob MFU on active parameters;
           --sequential-experts runs them with model.moe.grouped_experts=false.

MoE roofline of a rollout (from this call's per-row lengths and recorded routing):
    prefill: 2 x active matmul params x prompt tokens (+ attention 4 x layers x n^2/2 x q width)
             / measured bf16 matmul rate;
    decode step k (R rows live): max(bytes / measured copy bandwidth, FLOPs / matmul rate),
      bytes = dense weights (attention, routers, head) + experts touched x expert bytes
              + KV bytes of the live rows' contexts,
      experts touched = per layer, the distinct experts the R live rows' tokens were routed to
              at that step (read from the engine's recorded routing: all 128 once there are
              enough rows, the routed ones otherwise),
      FLOPs = 2 x active matmul params x R + attention (4 x layers x q width x context).
Active matmul params per token = attention + router + top-k experts per layer, + the head.
MFU: update 6 x active x tokens / time, logprob passes 2 x active x tokens x passes / time,
both / measured matmul rate (tokens: prompt + response of every rollout).

    # one H200, unattended, < 4 min (defaults: --parts experts,rollout, 6 layers); results in
    # benchmarks/results/moe_grpo_shaped_results.json (--out DIR to write elsewhere)
    python3 benchmarks/moe_grpo_shaped.py
    # the whole GRPO step (longer: the trainer's setup and optimizer of 4.4 B parameters)
    python3 benchmarks/moe_grpo_shaped.py --parts step
    python3 benchmarks/moe_grpo_shaped.py --parts step --sequential-experts
    # CPU smoke test (the tiny Qwen3-MoE, fp32, 4 prompts x 2 samples, cap 16)
    uv run python benchmarks/moe_grpo_shaped.py --tiny --out /tmp/moe-grpo-shaped
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpo_shaped as gs  # noqa: E402  (ceilings, timing, the step wrapper)

RECIPE = ROOT / "recipes" / "tiny-qwen3-moe-text-1n1g-cpu.yaml"
RESULTS = "moe_grpo_shaped_results.json"


# ----------------------------------------------------------------------------- model


def bench_checkpoint(path: Path, tiny: bool, layers: int, device: torch.device) -> Path:
    from rlflow.model.families.qwen3_moe import PRESETS, write_tiny_qwen3_moe

    if not (path / "config.json").exists():
        sizes = PRESETS["tiny"] if tiny else dataclasses.replace(
            PRESETS["qwen3-30b-a3b"], layers=layers
        )  # fmt: skip
        staging = path.with_name(path.name + f".tmp{os.getpid()}")
        write_tiny_qwen3_moe(staging, seed=0, sizes=sizes, device=str(device))
        os.replace(staging, path)
    return path


def model_counts(checkpoint: Path, dtype_bytes: int) -> dict:
    """Parameter counts from config.json: total, active per token, dense and per-expert bytes."""
    config = json.loads((checkpoint / "config.json").read_text())
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    from rlflow.model.moe.experts import num_experts

    experts, topk = num_experts(config), config["num_experts_per_tok"]
    ffn, vocab = config["moe_intermediate_size"], config["vocab_size"]
    attention = h * heads * d * 2 + h * kv * d * 2  # q, o; k, v
    expert = 3 * h * ffn
    router = experts * h
    head = vocab * h
    dense_layer = attention + router
    return {
        "layers": layers,
        "experts": experts,
        "topk": topk,
        "vocab_size": vocab,
        "total_params": layers * (dense_layer + experts * expert) + 2 * head,
        "expert_params": layers * experts * expert,
        "active_matmul_params": layers * (dense_layer + topk * expert) + head,
        "head_params": head,
        "dense_weight_bytes": (layers * dense_layer + head) * dtype_bytes,
        "expert_bytes": expert * dtype_bytes,
        "q_width": heads * d,
        "kv_bytes_per_token": layers * 2 * kv * d * dtype_bytes,
    }


def moe_roofline(prompts, completions, c: dict, ceil: dict) -> dict:
    """The MoE roofline of one rollout call (module docstring), touched experts from routing."""
    matmul, copy = ceil["matmul_tflop_s"] * 1e12, ceil["copy_tb_s"] * 1e12
    unique = list({id(p): p for p in prompts}.values())
    body = c["active_matmul_params"] - c["head_params"]
    prefill = sum(
        2 * body * len(p.token_ids) + 2 * c["head_params"]
        + 4 * c["layers"] * len(p.token_ids) ** 2 / 2 * c["q_width"]
        for p in unique
    )  # fmt: skip
    prompt_len = torch.tensor([len(p.token_ids) for p in prompts])
    lengths = torch.tensor([len(x.token_ids) for x in completions])
    steps = int(lengths.max()) - 1
    experts, layers = c["experts"], c["layers"]
    # generated[row, j]: the experts of generated token j (fed at decode step j + 1), E = none
    generated = torch.full((len(completions), max(steps, 1), layers, c["topk"]), experts)
    for i, x in enumerate(completions):
        n = min(len(x.token_ids) - 1, steps)
        routed = x.routing[len(x.routing) - len(x.token_ids) :][:n].long()
        generated[i, :n] = torch.where(routed < 0, experts, routed)
    decode_s, memory_bound, touched_sum = 0.0, 0, 0.0
    for k in range(1, steps + 1):  # step k feeds generated token k-1
        live = lengths > k
        context = int((prompt_len[live] + k).sum())
        chosen = generated[live, k - 1].permute(1, 0, 2).reshape(layers, -1)  # [layers, R*k]
        hit = torch.zeros(layers, experts + 1).scatter_(1, chosen, 1.0)[:, :experts]
        touched = int(hit.sum())
        touched_sum += touched / layers
        by_bytes = (
            c["dense_weight_bytes"]
            + touched * c["expert_bytes"]
            + c["kv_bytes_per_token"] * context
        ) / copy
        rows = int(live.sum())
        flops = 2 * c["active_matmul_params"] * rows + 4 * layers * c["q_width"] * context
        decode_s += max(by_bytes, flops / matmul)
        memory_bound += by_bytes >= flops / matmul
    total = prefill / matmul + decode_s
    return {
        "prefill_s": prefill / matmul,
        "decode_steps": steps,
        "decode_s": decode_s,
        "memory_bound_steps": memory_bound,
        "mean_experts_touched_per_layer": touched_sum / max(steps, 1),
        "total_s": total,
        "useful_tokens": int(lengths.sum()),
        "tokens_per_s": float(lengths.sum()) / total,
    }


# ----------------------------------------------------------------------------- workload


def make_samples(n: int, seed: int, tokenizer) -> list:
    from rlflow.data.sample import Sample

    samples = []
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        target, words = rng.randint(10, 120), []
        while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < target:
            words.append(rng.choice(gs.WORDS))
        samples.append(
            Sample(
                id=f"moe-grpo-shaped/{seed}/{i}", media="text",
                question=" ".join(words).capitalize() + "?", answer="0", images=(), video=None,
                kind="text",
            )
        )  # fmt: skip
    return samples


# ----------------------------------------------------------------------------- parts


def run_experts(device, dtype, tiny: bool, log) -> dict:
    """Grouped vs sequential experts on one layer, and the engine's routed decode step."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rlflow.generation.megatron.moe_decode import MoEWeights, routed_experts
    from rlflow.model.moe.experts import GroupedExperts

    experts, topk, hidden, ffn = (8, 2, 128, 64) if tiny else (128, 8, 2048, 768)
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn, num_moe_experts=experts, moe_router_topk=topk,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu",  # built in place: .to() would split the
        # grouped experts' one weight block into separate tensors
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
    )  # fmt: skip
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    pgs = get_default_pg_collection()
    grouped = GroupedExperts()(experts, config, submodules, pg_collection=pgs)
    sequential = SequentialMLP(experts, config, submodules, pg_collection=pgs)
    sequential.load_state_dict(grouped.state_dict())
    out = {"shape": {"experts": experts, "topk": topk, "hidden": hidden, "ffn": ffn}}
    reps = 3 if tiny else 10
    for tokens in (512, 4096, 16384) if not tiny else (64,):
        gen = torch.Generator().manual_seed(tokens)
        counts = torch.multinomial(torch.ones(experts), tokens * topk, True, generator=gen)
        per_expert = torch.bincount(counts, minlength=experts)
        x = torch.randn(tokens * topk, hidden, generator=gen).to(device, dtype)
        probs = torch.rand(tokens * topk, generator=gen).to(device)
        grad = torch.randn(tokens * topk, hidden, generator=gen).to(device, dtype)
        row = {}
        results = {}
        for name, module in (("grouped", grouped), ("sequential", sequential)):

            def step(module=module, x=x, per_expert=per_expert, probs=probs, grad=grad):
                inp = x.detach().requires_grad_()
                y, _ = module(inp, per_expert, probs)
                y.backward(grad)
                return y, inp.grad

            step()
            gs._sync(device)
            start = time.perf_counter()
            for _ in range(reps):
                results[name] = step()
            gs._sync(device)
            row[f"{name}_ms"] = 1e3 * (time.perf_counter() - start) / reps
            module.zero_grad(set_to_none=True)
        flops = 3 * 2 * 3 * hidden * ffn * tokens * topk  # fwd + 2x bwd, three matmuls
        row["grouped_tflop_s"] = flops / row["grouped_ms"] / 1e9
        row["speedup"] = row["sequential_ms"] / row["grouped_ms"]
        row["max_abs_diff_out"] = float(
            (results["grouped"][0] - results["sequential"][0]).abs().max()
        )
        out[f"train_{tokens}_tokens"] = row
        log(f"experts, {tokens} tokens: {json.dumps(row)}")
    fc1, fc2 = grouped.stacked_weights()
    w = MoEWeights(
        norm=None, router=None, router_bias=None, expert_bias=None, fc1=fc1, fc2=fc2, first=0,
        topk=topk, pre_softmax=False, score_function="softmax", scaling=None, num_groups=None,
        group_topk=None, router_dtype=None, ep_group=None,
    )  # fmt: skip
    for rows in (64, 512) if not tiny else (8,):
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, hidden, generator=gen).to(device, dtype)
        chosen = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(rows)])
        chosen, probs = chosen.to(device), torch.rand(rows, topk, generator=gen).to(device, dtype)
        with torch.no_grad():
            routed_experts(x, chosen, probs, w)
            gs._sync(device)
            start = time.perf_counter()
            for _ in range(reps):
                routed_experts(x, chosen, probs, w)
            gs._sync(device)
        touched = len(set(chosen.flatten().tolist()))
        ms = 1e3 * (time.perf_counter() - start) / reps
        bytes_read = touched * 3 * hidden * ffn * torch.finfo(dtype).bits // 8
        out[f"decode_{rows}_rows"] = {"ms": ms, "experts_touched": touched,
                                      "weight_tb_s": bytes_read / ms / 1e9}  # fmt: skip
        log(f"engine routed experts, {rows} rows: {json.dumps(out[f'decode_{rows}_rows'])}")
    return out


def run_rollout(policy, prompts, params, args, ceil, counts, device, log) -> dict:
    from rlflow.generation.megatron.engine import MegatronGeneration

    backend = MegatronGeneration(
        policy, pad_token_id=args.pad_token_id, max_batch_size=0, cuda_graphs=True,
        compile_decode=not args.tiny, share_prompts=True, fp8=False, release_cache=False,
        cache_tokens=0,
    )  # fmt: skip
    warm_s, _ = gs.timed_generate(backend, prompts, params, device)
    log(f"rollout: warm-up {warm_s:.1f} s (graph capture included)")
    gs._reset_peak(device)
    runs = []
    for rep in range(args.reps):
        seconds, completions = gs.timed_generate(backend, prompts, params, device)
        stats = gs.length_stats(completions)
        roof = moe_roofline(prompts, completions, counts, ceil)
        runs.append({"seconds": seconds, **stats, "tokens_per_s": stats["useful_tokens"] / seconds,
                     "percent_of_roofline": 100 * roof["total_s"] / seconds, "roofline": roof})  # fmt: skip
        log(f"rollout {rep + 1}: {seconds:.2f} s, {runs[-1]['tokens_per_s']:,.0f} tok/s, "
            f"{runs[-1]['percent_of_roofline']:.1f}% of the MoE roofline")  # fmt: skip
    backend.close()
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "percent_of_roofline": statistics.median(r["percent_of_roofline"] for r in runs),
        "warmup_s": warm_s,
        "peak_gib": gs._peak(device),
        "runs": runs,
        "engine_timings": backend.last_timings,
    }


def run_steps(loaded, samples, stop_ids, args, ceil, counts, info, log) -> dict:
    from rlflow.data import PromptSampler
    from rlflow.train import loop
    from rlflow.train.setup import setup

    run_dir = Path(tempfile.mkdtemp(prefix="rlflow-bench-moe-"))
    start = time.perf_counter()
    t = setup(loaded, run_dir)
    t.train_data = samples
    t.sampler = PromptSampler(len(samples), len(samples), args.seed)
    # The rollouts read the trainer's RolloutContext (rlflow/train/collect.py): hand them the
    # same data and sampler, or they would draw the recipe's own dataset.
    t.context = dataclasses.replace(t.context, train_data=samples, sampler=t.sampler)
    t.rollouts.context = t.context
    sampling = gs.BenchmarkSampling(t.backend.generate, info.device)
    sampling.stop_ids = stop_ids
    t.backend.generate = sampling
    loop._resume_or_start(t)
    log(f"step: trainer built in {time.perf_counter() - start:.1f} s")
    rate = ceil["matmul_tflop_s"] * 1e12
    passes = 2 if t.reference is not None else 1
    active = counts["active_matmul_params"]
    rows = []
    for _ in range(args.steps):
        step = t.step + 1
        if args.profile and step == args.steps:  # the last step: graphs captured, caches warm
            metrics = _profiled(
                lambda s=step: loop.grpo_step(t, s), args.out / "moe_step_profile.txt"
            )
        else:
            metrics = loop.grpo_step(t, step)
        t.step = step
        call = sampling.calls[-1]
        tokens = call["prompt_tokens"] + call["useful_tokens"]
        row = {
            "step": step,
            **{k: v for k, v in metrics.items() if k.startswith(("time/", "memory/", "moe/"))},
            "tokens": tokens,
            "tokens_per_s_per_gpu": tokens / metrics["time/step"],
            "update_mfu": 6 * active * tokens / metrics["time/training"] / rate,
            "logprob_mfu": 2 * active * tokens * passes / metrics["time/logprobs"] / rate,
            "token_mult_prob_error": metrics.get("train/token_mult_prob_error"),
        }
        rows.append(row)
        log(f"step {step}: {row['time/step']:.1f} s, {row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, "
            f"MFU update {100 * row['update_mfu']:.1f}% logprobs {100 * row['logprob_mfu']:.1f}%, "
            f"routing agreement {row.get('moe/routing_agreement', float('nan')):.4f}")  # fmt: skip
    t.backend.close()
    t.log.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    later = rows[1:] or rows  # step 1 includes graph capture and compilation
    keys = [k for k in rows[0] if k != "step" and isinstance(rows[0][k], float)]
    return {
        "grouped_experts": not args.sequential_experts,
        "median_of_steps_2_on": {k: statistics.median(r[k] for r in later if k in r) for k in keys},
        "steps": rows,
    }


def _profiled(call, path: Path):
    """Run call() under torch.profiler; write the ops by GPU and by CPU time to path."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = call()
        torch.cuda.synchronize()
    table = prof.key_averages()
    path.write_text(
        "# by GPU time\n" + table.table(sort_by="cuda_time_total", row_limit=45)
        + "\n# by CPU time (self)\n" + table.table(sort_by="self_cpu_time_total", row_limit=30)
    )  # fmt: skip
    return result


# ----------------------------------------------------------------------------- driver


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="tiny model, fp32: CPU smoke test")
    parser.add_argument("--parts", default="experts,rollout", help="experts,rollout,step")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers (module doc)")
    parser.add_argument("--prompts", type=int, default=None, help="unique prompts (64; tiny 4)")
    parser.add_argument("--samples", type=int, default=None, help="rollouts per prompt (8; 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="cap (256; tiny 16)")
    parser.add_argument("--stop-every", type=int, default=80)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (4; tiny 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sequential-experts", action="store_true",
                        help="step: model.moe.grouped_experts=false (megatron's SequentialMLP)")  # fmt: skip
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="profile the last step; ops tables to OUT/moe_step_profile.txt")  # fmt: skip
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (4 if args.tiny else 64)
    args.samples = args.samples or (2 if args.tiny else 8)
    args.max_new_tokens = args.max_new_tokens or (16 if args.tiny else 256)
    args.steps = args.steps or (2 if args.tiny else 4)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - {"experts", "rollout", "step"})
    if unknown:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown)}; use experts,rollout,step")
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    name = "rlflow-bench-moe-tiny" if args.tiny else f"rlflow-bench-qwen3-30b-a3b-{args.layers}l"
    args.checkpoint = args.checkpoint or tmp / name
    return args


def overrides(args, checkpoint: Path) -> list[str]:
    return [
        f"model.checkpoint={checkpoint}",
        f"model.dtype={'float32' if args.tiny else 'bfloat16'}",
        f"model.moe.grouped_experts={str(not args.sequential_experts).lower()}",
        f"grpo.num_prompts_per_step={args.prompts}",
        f"grpo.num_generations_per_prompt={args.samples}",
        f"grpo.max_num_steps={10 * args.steps + 10}",
        "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "grpo.dynamic_sampling.enabled=false", "warm_start.num_steps=0",
        f"generation.max_new_tokens={args.max_new_tokens}",
        f"generation.compile_decode={str(not args.tiny).lower()}",
        "data.max_prompt_tokens=2048", "checkpointing.enabled=false",
        "logging.tensorboard=false", "logging.progress_bar=false",
        *args.override,
    ]  # fmt: skip


def main() -> None:
    args = parse_args()
    from rlflow import parallel
    from rlflow.compat import library_logs
    from rlflow.rules import load_checked

    library_logs.quiet()
    began = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f} s] {message}", flush=True)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    checkpoint = bench_checkpoint(args.checkpoint, args.tiny, args.layers, device)
    loaded = load_checked(RECIPE, overrides(args, checkpoint))
    info = parallel.init_parallel(
        loaded.recipe.parallelism,
        args.seed,
        timeout_s=loaded.recipe.watchdog.collective_timeout_s,
        placement=None,
    )
    dtype = torch.float32 if args.tiny else torch.bfloat16
    counts = model_counts(checkpoint, 4 if args.tiny else 2)
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "argv": sys.argv[1:], "model": counts,
        "checkpoint_s": time.perf_counter() - start, "ceilings": gs.ceilings(device),
        "workload": {"prompts": args.prompts, "samples": args.samples,
                     "max_new_tokens": args.max_new_tokens, "stop_every": args.stop_every},
    }  # fmt: skip
    ceil = results["ceilings"]
    if args.tiny:  # no GPU ceilings: nominal ones keep the arithmetic going
        ceil.update(copy_tb_s=0.01, matmul_tflop_s=0.1)

    def save() -> None:
        path = args.out / RESULTS
        previous = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**previous, **results}, indent=2, default=gs._plain))

    log(f"model {json.dumps(counts)}; ceilings {json.dumps(ceil)}")
    save()
    if "experts" in args.parts:
        results["experts"] = run_experts(device, dtype, args.tiny, log)
        save()
    from rlflow.generation.base import SamplingParams
    from rlflow.model.processor import PromptEncoder

    encoder = PromptEncoder(checkpoint, loaded.recipe.data)
    args.pad_token_id = encoder.pad_token_id
    samples = make_samples(args.prompts, args.seed, encoder.tokenizer)
    unique = [encoder.encode(s) for s in samples]
    prompts = [p for p in unique for _ in range(args.samples)]
    stop_ids = gs.stop_token_ids(counts["vocab_size"], args.stop_every, args.seed)
    params = SamplingParams(args.max_new_tokens, 1.0, 1.0, 0, args.seed, stop_ids, False)
    if "rollout" in args.parts:
        from rlflow.model.build import load_policy

        start = time.perf_counter()
        policy = load_policy(checkpoint, loaded.recipe.model, loaded.recipe.parallelism, False)
        results["load_policy_s"] = time.perf_counter() - start
        log(f"policy loaded in {results['load_policy_s']:.1f} s")
        results["rollout"] = run_rollout(policy, prompts, params, args, ceil, counts, device, log)
        save()
        del policy
        gs._free(device)
    if "step" in args.parts:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()  # setup() initialises it again
        key = "step_sequential" if args.sequential_experts else "step"
        results[key] = run_steps(loaded, samples, stop_ids, args, ceil, counts, info, log)
        save()
    parallel.shutdown()
    log("done: " + str(args.out / RESULTS))


if __name__ == "__main__":
    main()
