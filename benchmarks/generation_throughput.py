"""Multimodal rollout throughput: rlflow's Megatron generation vs HF `generate` vs the roofline.

Workload (as in the issue and ../shared/docs/anchor-generation.md): a Qwen2.5-VL-3B-shaped model
with random weights in bf16, 64 prompts of 104 tokens (one 224x224 image = 64 visual tokens, plus
40 text tokens), exactly 256 new tokens each, greedy and T=1 sampling. Everything is measured in
one process on one GPU: the ceilings (device-to-device copy bandwidth, bf16 matmul rate), HF
`generate` (sdpa) and rlflow's backend on the same weights.

The model goes through rlflow's real path: HF checkpoint on disk -> megatron-bridge -> Megatron
policy (`rlflow.model.build.load_policy`).

    python benchmarks/generation_throughput.py --out DIR              # H200 (see results file)
    python benchmarks/generation_throughput.py --tiny --out DIR       # CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlflow import parallel  # noqa: E402
from rlflow.generation.base import Prompt, SamplingParams  # noqa: E402
from rlflow.generation.megatron.engine import MegatronGeneration  # noqa: E402
from rlflow.model.media import Media  # noqa: E402
from rlflow.recipe.schema import ParallelismConfig  # noqa: E402
from tests.tiny import FP32  # noqa: E402


def write_random_checkpoint(path: Path, preset: str, device: torch.device) -> Path:
    """rlflow's own random checkpoint (`rlflow init-tiny-model --preset`), weights made on the GPU."""
    from rlflow.model.tiny import PRESETS, write_tiny_checkpoint

    if not (path / "config.json").exists():
        write_tiny_checkpoint(path, seed=0, sizes=PRESETS[preset], device=str(device))
    return path


def make_prompts(config, n: int, image: int, device) -> list[Prompt]:
    """n prompts: 20 text tokens, <vision_start>, (image/28)^2 image pads, <vision_end>, 18 text."""
    patches = image // 14
    pads = patches * patches // 4
    generator = torch.Generator().manual_seed(1)
    prompts = []
    for i in range(n):
        # ordinary tokens of rlflow's tokenizer (ids 0-7 are its special tokens)
        text = torch.randint(16, 500, (38,), generator=generator).tolist()
        ids = (
            text[:20]
            + [config.vision_start_token_id]
            + [config.image_token_id] * pads
            + [config.vision_end_token_id]
            + text[20:]
        )
        pixels = torch.randn(patches * patches, 3 * 2 * 14 * 14, generator=generator)
        media = Media(pixel_values=pixels, image_grid_thw=torch.tensor([[1, patches, patches]]))
        prompts.append(Prompt(f"p{i}", "", tuple(ids), media))
    return prompts


def ceilings(device) -> dict:
    """Measured copy bandwidth (bytes read + written) and bf16 matmul rate on this device."""
    if device.type != "cuda":
        return {"copy_tb_s": float("nan"), "matmul_tflop_s": float("nan")}
    src = torch.empty(2**31, dtype=torch.bfloat16, device=device)  # 4 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    copy = 10 * 2 * src.numel() * 2 / (time.perf_counter() - start) / 1e12
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        c = a @ b
    torch.cuda.synchronize()
    matmul = 10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12
    del a, b, c
    torch.cuda.empty_cache()
    return {"copy_tb_s": copy, "matmul_tflop_s": matmul}


def roofline(hf_model, prompts, new_tokens: int, ceil: dict) -> dict:
    """Decode: LM weights (tied head once) + mean KV read per step / copy bandwidth.
    Prefill: 2 x params x tokens for the LM and the vision tower (plus attention) / matmul rate."""
    text = hf_model.config.text_config
    lm_params = sum(p.numel() for n, p in hf_model.named_parameters() if "visual" not in n)
    vision_params = sum(p.numel() for n, p in hf_model.named_parameters() if "visual" in n)
    embedding = text.vocab_size * text.hidden_size
    batch, prompt_len = len(prompts), len(prompts[0].token_ids)
    head_dim = text.hidden_size // text.num_attention_heads
    kv_per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 2
    mean_context = prompt_len + new_tokens / 2
    step_bytes = lm_params * 2 + batch * mean_context * kv_per_token
    patches = sum(int(p.media.pixel_values.shape[0]) for p in prompts)
    attention = 4 * text.num_hidden_layers * batch * prompt_len**2 / 2 * text.hidden_size
    prefill_flops = (
        2 * (lm_params - embedding) * batch * prompt_len
        + 2 * vision_params * patches
        + attention
        + 2 * embedding * batch
    )
    step_s = step_bytes / (ceil["copy_tb_s"] * 1e12)
    ttft_s = prefill_flops / (ceil["matmul_tflop_s"] * 1e12)
    total = ttft_s + (new_tokens - 1) * step_s
    return {
        "decode_step_ms": 1e3 * step_s,
        "ttft_ms": 1e3 * ttft_s,
        "total_s": total,
        "tokens_per_s": batch * new_tokens / total,
        "prefill_tflop": prefill_flops / 1e12,
        "step_gbytes": step_bytes / 1e9,
    }


def time_hf(model, prompts, new_tokens: int, reps: int, sample: bool, device) -> dict:
    ids = torch.tensor([p.token_ids for p in prompts], device=device)
    media = Media.concat([p.media for p in prompts]).to(device)
    types = torch.zeros_like(ids)
    types[ids == model.config.image_token_id] = 1
    kwargs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=types,
        pixel_values=media.pixel_values.to(torch.bfloat16),
        image_grid_thw=media.image_grid_thw,
        do_sample=sample,
        temperature=1.0 if sample else None,
        top_p=None,
        top_k=None,
        pad_token_id=0,
    )

    def run(n):
        _sync(device)
        start = time.perf_counter()
        model.generate(**kwargs, max_new_tokens=n, min_new_tokens=n)
        _sync(device)
        return time.perf_counter() - start

    run(new_tokens)  # warm-up
    _reset_peak(device)
    totals = [run(new_tokens) for _ in range(reps)]
    ttft = statistics.median(run(1) for _ in range(3))
    return _summary(totals, ttft, len(prompts), new_tokens, device)


def time_rlflow(
    backend: MegatronGeneration, prompts, new_tokens: int, reps: int, sample: bool, device
):
    params = SamplingParams(
        max_new_tokens=new_tokens,
        temperature=1.0 if sample else 0.0,
        top_p=1.0,
        top_k=0,
        seed=0,
        stop_token_ids=(),
        ignore_eos=True,
    )
    backend.generate(prompts, params)  # warm-up: captures the CUDA graph for this shape
    _reset_peak(device)
    totals, ttfts = [], []
    for _ in range(reps):
        backend.generate(prompts, params)
        totals.append(backend.last_timings["total_s"])
        ttfts.append(backend.last_timings["prefill_s"])
    return _summary(totals, statistics.median(ttfts), len(prompts), new_tokens, device)


def _summary(totals, ttft, batch, new_tokens, device) -> dict:
    total = statistics.median(totals)
    return {
        "tokens_per_s": batch * new_tokens / total,
        "total_s": total,
        "ttft_ms": 1e3 * ttft,
        "decode_step_ms": 1e3 * (total - ttft) / (new_tokens - 1),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30
        if device.type == "cuda"
        else float("nan"),
        "runs_s": totals,
    }


def agreement(backend, hf_model, prompts, device, new_tokens: int = 16) -> dict:
    """Greedy agreement in bf16 (random weights: near-flat logits, so bf16 noise flips some)."""
    params = SamplingParams(new_tokens, 0.0, 1.0, 0, 0, (), True)
    ours = backend.generate(prompts, params)
    ids = torch.tensor([p.token_ids for p in prompts], device=device)
    media = Media.concat([p.media for p in prompts]).to(device)
    types = torch.zeros_like(ids)
    types[ids == hf_model.config.image_token_id] = 1
    ref = hf_model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=types,
        pixel_values=media.pixel_values.to(torch.bfloat16),
        image_grid_thw=media.image_grid_thw,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    ref = ref[:, ids.shape[1] :].tolist()
    first = sum(a.token_ids[0] == b[0] for a, b in zip(ours, ref))
    prefix = []
    for a, b in zip(ours, ref):
        n = 0
        while n < new_tokens and a.token_ids[n] == b[n]:
            n += 1
        prefix.append(n)
    return {
        "first_token_match": f"{first}/{len(prompts)}",
        "mean_identical_prefix": statistics.mean(prefix),
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--tiny", action="store_true", help="tiny model, CPU smoke test of the script"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--variants",
        default="graph,graph+compile",
        help="rlflow variants: eager, graph, graph+compile",
    )
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from rlflow.compat import library_logs
    from rlflow.model.build import load_policy

    library_logs.quiet()
    parallel.init_parallel(
        ParallelismConfig(1, 1, 1, 1, "off"), seed=0, timeout_s=1800, placement=None
    )
    results: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
    }
    ckpt = Path(os.environ.get("TMPDIR", "/tmp")) / (
        "rlflow-bench-tiny" if args.tiny else "rlflow-bench-3b"
    )
    start = time.perf_counter()
    write_random_checkpoint(ckpt, "tiny" if args.tiny else "qwen25vl-3b", device)
    results["checkpoint_write_s"] = time.perf_counter() - start
    results["ceilings"] = ceil = ceilings(device)
    print(json.dumps(results), flush=True)

    start = time.perf_counter()
    model_cfg = dataclasses.replace(FP32, checkpoint=str(ckpt), dtype="bfloat16")
    policy = load_policy(ckpt, model_cfg, ParallelismConfig(1, 1, 1, 1, "off"), trainable=False)
    results["load_policy_s"] = time.perf_counter() - start
    from rlflow.generation.hf import load_hf_model

    hf_model = load_hf_model(ckpt, torch.bfloat16, device)
    prompts = make_prompts(hf_model.config, args.batch, 56 if args.tiny else 224, device)
    results["prompt_tokens"] = len(prompts[0].token_ids)
    results["roofline"] = roofline(hf_model, prompts, args.new_tokens, ceil)
    print(json.dumps(results["roofline"]), flush=True)

    for variant in args.variants.split(","):
        backend = MegatronGeneration(
            policy,
            pad_token_id=0,
            max_batch_size=args.batch,
            cuda_graphs="graph" in variant,
            compile_decode="compile" in variant,
            share_prompts=True,
            fp8=False,
            release_cache=False,
            cache_tokens=0,
        )
        try:
            start = time.perf_counter()
            row = {
                "greedy": time_rlflow(backend, prompts, args.new_tokens, args.reps, False, device),
                "sample_t1": time_rlflow(
                    backend, prompts, args.new_tokens, args.reps, True, device
                ),
            }
            row["setup_and_timing_s"] = time.perf_counter() - start
            row["agreement_vs_hf"] = agreement(backend, hf_model, prompts[:16], device)
        except Exception as err:  # a variant that fails is reported, the others still run
            row = {"error": f"{type(err).__name__}: {err}"[:500]}
        results[f"rlflow_{variant}"] = row
        backend.close()
        print(variant, json.dumps(row), flush=True)
        (args.out / "generation_results.json").write_text(json.dumps(results, indent=2))

    if not args.skip_hf:
        results["hf_generate_sdpa"] = {
            "greedy": time_hf(hf_model, prompts, args.new_tokens, args.reps, False, device),
            "sample_t1": time_hf(hf_model, prompts, args.new_tokens, args.reps, True, device),
        }
        print("hf", json.dumps(results["hf_generate_sdpa"]), flush=True)
    (args.out / "generation_results.json").write_text(json.dumps(results, indent=2))
    print_table(results)


def print_table(results: dict) -> None:
    roof = results["roofline"]
    hf = results.get("hf_generate_sdpa", {}).get("greedy")
    print(
        f"\n{'system':34} {'tok/s':>9} {'% roof':>7} {'x HF':>6} {'ms/step':>8} {'TTFT ms':>8} {'peak GiB':>9}"
    )
    rows = [
        (k, v["greedy"]) for k, v in results.items() if k.startswith("rlflow_") and "greedy" in v
    ]
    if hf:
        rows.append(("hf_generate_sdpa", hf))
    for name, r in rows:
        ratio = r["tokens_per_s"] / hf["tokens_per_s"] if hf else float("nan")
        print(
            f"{name:34} {r['tokens_per_s']:9,.0f} {100 * r['tokens_per_s'] / roof['tokens_per_s']:6.1f}% "
            f"{ratio:6.2f} {r['decode_step_ms']:8.2f} {r['ttft_ms']:8.0f} {r['peak_gib']:9.1f}"
        )
    print(
        f"{'roofline (prefill + decode)':34} {roof['tokens_per_s']:9,.0f} {100.0:6.1f}% {'':6} "
        f"{roof['decode_step_ms']:8.2f} {roof['ttft_ms']:8.0f}"
    )


if __name__ == "__main__":
    main()
