"""GRPO-shaped rollouts and whole GRPO steps on the Qwen2.5-VL-3B shape (issues 9 and 20), or
with --model qwen3vl-4b on the Qwen3-VL-4B shape.

Workload, generated from seeds (no downloads), on a random-weight Qwen2.5-VL-3B-shaped checkpoint
(`rlflow init-tiny-model --preset qwen25vl-3b`), bf16:
- 64 prompts x 8 samples = 512 rollouts; each prompt object is repeated 8 times in a row, as
  rlflow's loop does (engines may detect the sharing by identity);
- media mix, seeded order: images of 112, 224, 336 and 448 px (16, 64, 144, 256 visual tokens),
  videos of 4 frames at 112 or 224 px (2 temporal patches: 32 or 128 tokens) and text-only rows;
  (Qwen3-VL's 32-pixel tokens: 16, 49, 100, 196 and 32 or 98);
- ragged questions of 10-120 text tokens (seeded), encoded by rlflow's own PromptEncoder with the
  checkpoint's processor (its pixel limit raised to 448x448 in a sibling checkpoint folder);
- T=1 sampling, cap 256 new tokens. Random weights never emit EOS, so a seeded random set of
  vocab/80 token ids is the stop set: near-flat logits stop each step with p ~ 1/80 (mean
  response ~ 80 tokens; the measured mean is reported).

Parts (--parts, any subset; one process may run at most ~9 minutes on the lent GPU), each run
for every engine variant in --variants (bf16, fp8; --fp8-parts limits the fp8 ones):
- rollout:  MegatronGeneration.generate on the 512 GRPO-shaped rollouts (cap 256): a warm-up,
            then the median of --reps timed calls. Useful tokens/s = tokens each row kept (up to
            and including its stop token) / synchronised wall clock of the whole call; the
            roofline (below) from THIS call's per-row lengths; the prefill against its compute
            roofline; peak memory; with --profile, one more call's top kernels and host gaps.
- long:     the same batch with long responses: cap --long-max-new-tokens (4096) and a stop set
            of vocab / --long-stop-every (1000) ids: a mean of ~1,000 tokens.
- fixed:    64 prompts with one 224-px image each, one row per prompt, exactly 256 tokens.
- hf:       HF `generate` (HFGeneration) on the same workload; on --hf-prompts prompts only
            (x samples rows), because HF is slow. Its tokens/s is measured on that subset; the
            full-batch time is extrapolated linearly in the number of --hf-batch chunks.
- mcore:    megatron-core's DynamicInferenceEngine, then its static engine, on the policy's
            language model (benchmarks/mcore_reference.py): tok/s, or exactly what fails.
- step, steplong, fixed256: whole GRPO steps (rlflow.train.setup + loop.grpo_step) on the
            GRPO-shaped, the long-response, or an every-row-256-tokens batch: seconds per phase
            (time/*), speed/* metrics, tokens/s/GPU, update and logprob MFU, the generation
            phase's share of its roofline, memory per step.
- steplong_partial: the steplong workload with partial rollouts (docs/partial-rollouts.md):
            generation stops at --partial-budget decode steps, unfinished rows continue in the
            next step, complete groups train. --partial-steps steps (its first steps fill the
            pipeline); tokens = the trained rows' prompt + response tokens (train/real_tokens).

GRPO-shaped roofline (issue 9): prefill FLOPs of the unique prompts (LM 2 x params x tokens +
vision tower 2 x vision params x patches + attention) / measured bf16 matmul rate, plus, for
every decode step up to the longest row, max((LM weight bytes + KV bytes of the rows still live)
/ measured copy bandwidth, (2 x LM params x live rows + attention FLOPs) / matmul rate). With
--tp 2 the ceilings of one GPU are multiplied by the number of GPUs.

    # one H200 (wheels as in generation_throughput.md; PYTHONPATH=/tmp/site:$PWD)
    python3 benchmarks/grpo_shaped.py --out $OUT --parts rollout,hf
    python3 benchmarks/grpo_shaped.py --out $OUT --parts step,fixed256
    # two H200s, tensor parallel 2 (two ranks through rlflow's local launcher; rank 0 reports)
    python3 benchmarks/grpo_shaped.py --out $OUT --tp 2 --parts rollout,step
    # the long step, partial rollouts off and on (benchmarks/grpo_shaped.md)
    python3 benchmarks/grpo_shaped.py --out $OUT --parts steplong,steplong_partial --steps 8
    # CPU smoke test of the script (tiny model, fp32, 4 prompts x 2 samples, cap 16)
    uv run python benchmarks/grpo_shaped.py --tiny --out /tmp/grpo-shaped
    # the Qwen3-VL-4B shape (init-tiny-model --preset qwen3vl-4b); CPU: --tiny --model qwen3vl
    python3 benchmarks/grpo_shaped.py --model qwen3vl-4b --out $OUT --parts rollout,step
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
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "vlm_grpo-qwen25vl-3b-clevr-4n8g-megatron-tp2.yaml"
RESULTS = "grpo_shaped_results.json"
# One cycle of row kinds (8 images, 2 videos, 2 text rows); the batch takes them in turn, then
# shuffles (seeded). ("image", 448) is a 448x448 image; ("video", 112) is 4 frames of 112x112.
KIND_CYCLE = [
    ("image", 112),
    ("video", 112),
    ("text", 0),
    ("image", 224),
    ("image", 336),
    ("video", 224),
    ("image", 448),
    ("text", 0),
    ("image", 112),
    ("image", 224),
    ("image", 336),
    ("image", 448),
]
VIDEO_FRAMES = 4  # temporal patch size 2: two temporal patches
MAX_PIXELS = 448 * 448  # the benchmark's processor limit: a 448x448 image keeps 32x32 patches
WORDS = (
    "how many are there in the image picture video scene clip frame objects shapes appear first "
    "last which came before after total of and or with a is it what count number answer please "
    "red green blue yellow purple cyan gray orange brown white black cube sphere cylinder square "
    "circle triangle ball block big small large tiny the each color size"
).split()


# ----------------------------------------------------------------------------- workload


def bench_checkpoint(
    base: Path, tiny: bool, device: torch.device, is_writer: bool, model: str = "qwen25vl-3b"
) -> Path:
    """rlflow's random checkpoint (`rlflow init-tiny-model --preset`), written once at `base`,
    and a sibling folder that links its files but raises the processor's pixel limits to
    448x448, so the four image sizes keep their resolution (the preset's limit is 224x224;
    Qwen3-VL's 256x256). Both families' processor configs keep the limits in the same keys:
    `size.longest_edge` in pixels (Qwen3-VL's video processor: pixels of all frames together,
    so its 4 x 224 x 224 videos fit its 262,144 as they are)."""
    target = base.with_name(base.name + "-grpo-shaped")
    if not is_writer:
        return target
    if not (base / "config.json").exists():
        if model == "qwen3vl-4b":
            from rlflow.model.families.qwen3vl import (
                QWEN3VL_PRESETS,
                Qwen3VLSizes,
                write_tiny_qwen3vl,
            )

            sizes = Qwen3VLSizes() if tiny else QWEN3VL_PRESETS[model]
            write_tiny_qwen3vl(base, seed=0, sizes=sizes, device=str(device))
        else:
            from rlflow.model.tiny import PRESETS, write_tiny_checkpoint

            sizes = PRESETS["tiny" if tiny else model]
            write_tiny_checkpoint(base, seed=0, sizes=sizes, device=str(device))
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for item in base.iterdir():
        if item.name != "processor_config.json":
            (staging / item.name).symlink_to(item.resolve())
    processor = json.loads((base / "processor_config.json").read_text())
    processor["image_processor"]["size"]["longest_edge"] = MAX_PIXELS
    processor["video_processor"]["size"]["longest_edge"] = max(
        MAX_PIXELS, processor["video_processor"]["size"]["longest_edge"]
    )
    (staging / "processor_config.json").write_text(json.dumps(processor, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def make_samples(n: int, seed: int, tokenizer, kind_cycle=KIND_CYCLE) -> list:
    """n rlflow Samples: seeded kinds (KIND_CYCLE), random-pixel media, ragged questions."""
    from PIL import Image

    from rlflow.data.sample import Sample

    kinds = [kind_cycle[i % len(kind_cycle)] for i in range(n)]
    random.Random(seed).shuffle(kinds)
    samples = []
    for i, (kind, size) in enumerate(kinds):
        rng = random.Random(seed * 1_000_003 + i)
        target = rng.randint(10, 120)  # text tokens of the question
        words: list[str] = []
        while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < target:
            words.append(rng.choice(WORDS))
        pixels = np.random.default_rng([seed, i])
        count = {"image": 1, "video": VIDEO_FRAMES}.get(kind, 0)
        frames = tuple(
            Image.fromarray(pixels.integers(0, 255, (size, size, 3), dtype=np.uint8))
            for _ in range(count)
        )
        images = frames if kind == "image" else ()
        video = frames if kind == "video" else None
        samples.append(
            Sample(
                id=f"grpo-shaped/{seed}/{i}",
                media=kind,
                question=" ".join(words).capitalize() + "?",
                answer="0",
                images=images,
                video=video,
                kind=f"{kind}{size or ''}",
            )
        )
    return samples


def stop_token_ids(vocab_size: int, every: int, seed: int) -> tuple[int, ...]:
    """vocab/every random token ids: under near-flat logits a step stops with p ~ 1/every."""
    generator = torch.Generator().manual_seed(seed + 7)
    return tuple(
        sorted(torch.randperm(vocab_size, generator=generator)[: vocab_size // every].tolist())
    )


# ----------------------------------------------------------------------------- ceilings


def ceilings(device: torch.device) -> dict:
    """Measured copy bandwidth (bytes read + written) and bf16 matmul rate (8192^3) on this
    device: the same method as generation_throughput.py."""
    if device.type != "cuda":
        return {"copy_tb_s": float("nan"), "matmul_tflop_s": float("nan")}
    src = torch.empty(2**31, dtype=torch.bfloat16, device=device)  # 4 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    copy = 10 * 2 * src.numel() * 2 / (time.perf_counter() - start) / 1e12
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        c = a @ b
    torch.cuda.synchronize(device)
    matmul = 10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12
    del a, b, c
    torch.cuda.empty_cache()
    return {"copy_tb_s": copy, "matmul_tflop_s": matmul}


# ----------------------------------------------------------------------------- model counts


def model_counts(checkpoint: Path, dtype_bytes: int) -> dict:
    """Parameter counts and shapes from the checkpoint's config (a meta-device model: no memory).

    lm_matmul_params are the LM weights a token multiplies through: the transformer layers and
    the output head (a tied head is the embedding matrix, counted once; an untied embedding is a
    lookup, not a matmul). Any Qwen-VL the checkpoint's config names (its HF class); Qwen3-VL's
    head_dim is its own (query width 4,096 on the 4B's 2,560 hidden) and its tower attends over
    each whole frame in every block (no windows); its DeepStack mergers are vision params."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(checkpoint))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    unique = {id(p): (n, p) for n, p in model.named_parameters(remove_duplicate=False)}.values()
    lm = sum(p.numel() for n, p in unique if "visual" not in n)
    vision = sum(p.numel() for n, p in unique if "visual" in n)
    text, vis = config.text_config, config.vision_config
    embedding = text.vocab_size * text.hidden_size
    tied = bool(getattr(text, "tie_word_embeddings", False) or config.tie_word_embeddings)
    matmul = lm if tied else lm - embedding
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    windows = hasattr(vis, "fullatt_block_indexes")  # Qwen2.5-VL's windowed tower
    full_layers = len(vis.fullatt_block_indexes) if windows else vis.depth
    return {
        "model_type": config.model_type,
        "total_params": lm + vision,
        "lm_params": lm,
        "lm_matmul_params": matmul,
        "head_params": embedding,
        "vision_params": vision,
        "vocab_size": text.vocab_size,
        "layers": text.num_hidden_layers,
        "q_width": text.num_attention_heads * head_dim,
        "kv_bytes_per_token": text.num_hidden_layers
        * 2
        * text.num_key_value_heads
        * head_dim
        * dtype_bytes,
        "weight_bytes": matmul * dtype_bytes,
        "vision_hidden": vis.hidden_size,
        "vision_depth": vis.depth,
        "vision_full_layers": full_layers,
        "vision_window_patches": (vis.window_size // vis.patch_size) ** 2 if windows else 0,
        "image_token_id": config.image_token_id,
        "video_token_id": config.video_token_id,
    }


def vision_flops(media, c: dict) -> float:
    """2 x vision params x patches, plus window / full attention within each frame group."""
    patches, attention = 0, 0.0
    for pixels, grids in (
        (media.pixel_values, media.image_grid_thw),
        (media.pixel_values_videos, media.video_grid_thw),
    ):
        if pixels is None:
            continue
        patches += int(pixels.shape[0])
        for t, h, w in grids.tolist():
            seq = h * w  # Qwen-VL towers attend within each temporal slice
            full = 4 * seq * seq * c["vision_hidden"] * c["vision_full_layers"]
            window = (
                4
                * seq
                * min(seq, c["vision_window_patches"])
                * c["vision_hidden"]
                * (c["vision_depth"] - c["vision_full_layers"])
            )
            attention += t * (full + window)
    return 2 * c["vision_params"] * patches + attention


def roofline(
    rollout_prompts, lengths: list[int], c: dict, ceil: dict, gpus: int, fp8: bool = False
) -> dict:
    """The issue's GRPO-shaped roofline from this run's per-row lengths (see module docstring).

    fp8: the decode step reads the layer weights in FP8 (1 byte each; the head stays bf16);
    compute is still counted at the bf16 matmul rate."""
    matmul = ceil["matmul_tflop_s"] * 1e12 * gpus
    copy = ceil["copy_tb_s"] * 1e12 * gpus
    weight_bytes = c["weight_bytes"]
    if fp8:
        head_bytes = c["weight_bytes"] * c["head_params"] // c["lm_matmul_params"]
        weight_bytes = (c["lm_matmul_params"] - c["head_params"]) + head_bytes
    unique = list({id(p): p for p in rollout_prompts}.values())
    body = c["lm_matmul_params"] - c["head_params"]  # no head over prompt tokens but the last
    prefill = 0.0
    for p in unique:
        n = len(p.token_ids)
        prefill += 2 * body * n + 2 * c["head_params"] + 4 * c["layers"] * n * n / 2 * c["q_width"]
        prefill += vision_flops(p.media, c)
    prompt_len = np.array([len(p.token_ids) for p in rollout_prompts])
    length = np.array(lengths)
    decode_s, memory_bound_steps = 0.0, 0
    for k in range(1, int(length.max())):  # step k feeds token k, makes token k+1
        live = length > k
        rows = int(live.sum())
        context = prompt_len[live] + k
        by_bytes = (weight_bytes + c["kv_bytes_per_token"] * context.sum()) / copy
        flops = 2 * c["lm_matmul_params"] * rows + 4 * c["layers"] * c["q_width"] * context.sum()
        by_flops = flops / matmul
        decode_s += max(by_bytes, by_flops)
        memory_bound_steps += int(by_bytes >= by_flops)
    prefill_s = float(prefill / matmul)
    total = prefill_s + float(decode_s)
    return {
        "unique_prompts": len(unique),
        "prefill_tflop": prefill / 1e12,
        "prefill_s": prefill_s,
        "decode_steps": int(length.max()) - 1,
        "decode_s": float(decode_s),
        "memory_bound_steps": memory_bound_steps,
        "total_s": total,
        "useful_tokens": int(length.sum()),
        "tokens_per_s": float(length.sum() / total),
        "gpus": gpus,
        "fp8_weights": fp8,
    }


# ----------------------------------------------------------------------------- rollout parts


def timed_generate(backend, prompts, params, device) -> tuple[float, list]:
    _sync(device)
    start = time.perf_counter()
    completions = backend.generate(prompts, params)
    _sync(device)
    return time.perf_counter() - start, completions


def length_stats(completions) -> dict:
    lengths = [len(c.token_ids) for c in completions]
    return {
        "rows": len(lengths),
        "useful_tokens": sum(lengths),
        "mean_response": statistics.mean(lengths),
        "median_response": statistics.median(lengths),
        "max_response": max(lengths),
        "rows_at_cap": sum(c.finish_reason == "length" for c in completions),
    }


def run_rollout(policy, prompts, params, args, ceil, counts, gpus, device, log, *, name: str,
                fp8: bool = False, warm_params=None, profile_params=None) -> dict:  # fmt: skip
    """One workload through MegatronGeneration as the recipes build it: a warm-up call (graph
    capture, compilation; `warm_params` may end it early with the same cache shape), then
    --reps timed calls, each against the roofline of its own per-row lengths; optionally one
    more, profiled call (`profile_params`: a shorter cap keeps the trace small)."""
    from rlflow.generation.megatron.engine import MegatronGeneration

    backend = MegatronGeneration(
        policy,
        pad_token_id=args.pad_token_id,
        max_batch_size=args.max_batch_size,
        cuda_graphs=True,
        compile_decode=args.compile_decode,
        share_prompts=True,
        fp8=fp8,
        release_cache=False,  # a rollout-only process: the engine keeps its cache and graphs
        cache_tokens=0,
    )
    warm_s, _ = timed_generate(backend, prompts, warm_params or params, device)
    log(f"{name}: warm-up {warm_s:.1f} s (graph capture / compile included)")
    _reset_peak(device)
    before = _allocated(device)
    runs = []
    for rep in range(args.reps):
        seconds, completions = timed_generate(backend, prompts, params, device)
        stats = length_stats(completions)
        # the roofline of exactly this call's work: its per-row lengths
        lengths = [len(c.token_ids) for c in completions]
        roof = roofline(prompts, lengths, counts, ceil, gpus, fp8=fp8)
        tokens_per_s = stats["useful_tokens"] / seconds
        timings = dict(backend.last_timings)
        runs.append(
            {
                "seconds": seconds,
                **stats,
                "tokens_per_s": tokens_per_s,
                "percent_of_roofline": 100 * roof["total_s"] / seconds,
                "prefill_s": timings.get("prefill_s"),
                "prefill_percent_of_roofline": 100 * roof["prefill_s"] / timings["prefill_s"]
                if timings.get("prefill_s")
                else None,
                "decode_ms_per_step": timings.get("decode_ms_per_step"),
                "roofline": roof,
            }
        )
        log(
            f"{name}: run {rep + 1}: {seconds:.2f} s, {stats['useful_tokens']} useful tokens "
            f"(mean response {stats['mean_response']:.1f}), {tokens_per_s:,.0f} tok/s, "
            f"{runs[-1]['percent_of_roofline']:.1f}% of roofline; prefill "
            f"{timings.get('prefill_s', 0):.3f} s vs {roof['prefill_s']:.3f} s"
        )
    peak = _peak(device)
    profile = prefill_profile = None
    if profile_params is not None and device.type == "cuda":
        profile = profile_call(backend, prompts, profile_params, device)
        brief = {k: v for k, v in profile.items() if k not in ("top", "top_cpu", "table")}
        log(f"{name}: profile {json.dumps(brief)}")
        # the prefill alone: a one-token call (prefill, the prompt logits, one sample)
        one = dataclasses.replace(params, max_new_tokens=1)
        prefill_profile = profile_call(backend, prompts, one, device)
        brief = {k: v for k, v in prefill_profile.items() if k not in ("top", "table")}
        log(f"{name}: prefill profile {json.dumps(brief)}")
    backend.close()
    roof = runs[0]["roofline"]
    out = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "seconds": statistics.median(r["seconds"] for r in runs),
        "percent_of_roofline": statistics.median(r["percent_of_roofline"] for r in runs),
        "fp8": fp8,
        "warmup_s": warm_s,
        "runs": runs,
        "engine_timings": getattr(backend, "last_timings", {}),
        "allocated_before_gib": before,
        "peak_gib": peak,
        "roofline": roof,
        "profile": profile,
        "prefill_profile": prefill_profile,
    }
    log(
        f"{name}: {out['tokens_per_s']:,.0f} useful tok/s = {out['percent_of_roofline']:.1f}% "
        f"of its roofline ({roof['tokens_per_s']:,.0f} tok/s: prefill "
        f"{roof['prefill_s'] * 1e3:.0f} ms + {roof['decode_steps']} decode steps "
        f"{roof['decode_s'] * 1e3:.0f} ms); peak {peak:.1f} GiB"
    )
    return out


def profile_call(backend, prompts, params, device) -> dict:
    """One profiled call: the top kernels by GPU time, the kernel count and the host gaps (wall
    time the GPU ran no kernel: host work the GPU waited for)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds, completions = timed_generate(backend, prompts, params, device)
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    table = averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
    steps = max(backend.last_timings.get("steps", 1), 1)
    return {
        "wall_s": seconds,
        "gpu_busy_s": busy_us / 1e6,
        "host_gap_s": max(seconds - busy_us / 1e6, 0.0),
        "kernel_launches": launches,
        "decode_steps": steps,
        "kernels_per_decode_step": launches / steps,
        "max_new_tokens": params.max_new_tokens,
        "useful_tokens": sum(len(c.token_ids) for c in completions),
        "top": [
            {
                "kernel": e.key[:120],
                "gpu_ms": e.self_device_time_total / 1e3,
                "calls": e.count,
                "share": e.self_device_time_total / max(busy_us, 1),
            }  # fmt: skip
            for e in top
        ],
        # host work: the operators with the most CPU time of their own
        "top_cpu": [
            {"op": e.key[:120], "cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
            for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:15]
        ],
        "table": table,
    }


def run_hf(policy, prompts, params, args, device, log) -> dict:
    """HF generate on the first --hf-prompts prompts (all their samples), in --hf-batch chunks."""
    from rlflow.generation.hf import HFGeneration

    rows = args.hf_prompts * args.samples
    subset = prompts[:rows]
    backend = HFGeneration(policy, args.pad_token_id, args.hf_batch)
    warm_s, _ = timed_generate(
        backend, subset[: args.hf_batch], dataclasses.replace(params, max_new_tokens=8), device
    )
    log(f"hf: warm-up {warm_s:.1f} s")
    _reset_peak(device)
    runs = []
    for rep in range(args.hf_reps):
        seconds, completions = timed_generate(backend, subset, params, device)
        stats = length_stats(completions)
        runs.append({"seconds": seconds, **stats, "tokens_per_s": stats["useful_tokens"] / seconds})
        log(f"hf: run {rep + 1}: {seconds:.1f} s, {runs[-1]['tokens_per_s']:,.0f} tok/s")
    median = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "tokens_per_s")}
    chunks_subset = -(-rows // args.hf_batch)
    chunks_full = -(-len(prompts) // args.hf_batch)
    out = {
        "measured_rows": rows,
        "full_rows": len(prompts),
        "batch": args.hf_batch,
        "tokens_per_s": median["tokens_per_s"],
        "seconds": median["seconds"],
        "runs": runs,
        "peak_gib": _peak(device),
        # HF runs one chunk after another: the whole batch costs about chunks_full / chunks_subset
        # times the subset (an extrapolation, not a measurement, when the subset is smaller).
        "estimated_full_batch_s": median["seconds"] * chunks_full / chunks_subset,
        "extrapolated": rows < len(prompts),
    }
    backend.close()
    del backend
    _free(device)
    return out


ROLLOUT_PARTS = {"rollout", "long", "fixed", "hf", "mcore"}


def run_rollout_parts(policy, prompts, params, long_params, samples, encoder, args, ceil, counts,
                      info, device, log, results, save) -> None:  # fmt: skip
    """The rollout workloads on one loaded policy, each engine variant (--variants) in turn:
    rollout (GRPO-shaped), long (long responses), fixed (64 image prompts x exactly 256
    tokens); then HF generate and megatron-core's engines. Every part is saved as it ends, and
    a part that fails is recorded as such (the others still run)."""
    gpus = info.world_size
    profile = args.profile and device.type == "cuda"

    def attempt(key: str, run, *a, **kw) -> None:
        try:
            results[key] = run(*a, **kw)
        except Exception as err:  # noqa: BLE001 - one failing part must not lose the others
            import traceback

            results[key] = {
                "failed": f"{type(err).__name__}: {err}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
            log(f"{key}: FAILED {results[key]['failed']}")
        save()

    # a warm-up that captures the same cache's graphs but stops quickly (1 in 4 tokens stops)
    quick_stop = stop_token_ids(counts["vocab_size"], 4, args.seed)
    long_warm = dataclasses.replace(long_params, stop_token_ids=quick_stop)
    fixed_samples = make_samples(args.prompts, args.seed + 1, encoder.tokenizer, [("image", 224)])
    fixed_prompts = [encoder.encode(x) for x in fixed_samples]  # one row per prompt
    fixed_params = dataclasses.replace(params, stop_token_ids=(), ignore_eos=True)
    long_profile = dataclasses.replace(long_params, max_new_tokens=512)
    workloads = {  # part: (prompts, params, warm-up params, profiled call's params)
        "rollout": (prompts, params, None, params),
        "long": (prompts, long_params, long_warm, long_profile),
        "fixed": (fixed_prompts, fixed_params, None, fixed_params),
    }
    for variant in args.variants:
        fp8 = variant == "fp8"
        for part, (rows, part_params, warm, profiled) in workloads.items():
            if part not in args.parts or (fp8 and part not in args.fp8_parts):
                continue
            name = part if variant == "bf16" else f"{part}_{variant}"
            # Each part builds a fresh engine, as a training process does once. torch.compile's
            # per-function cache would otherwise carry every earlier part's graphs: at its
            # recompile limit (8) dynamo falls back to eager for the rest of the process, which
            # slowed the second variant of one call (an FP8 run after a bf16 one)
            torch._dynamo.reset()
            attempt(name, run_rollout, policy, rows, part_params, args, ceil, counts, gpus,
                    device, log, name=name, fp8=fp8, warm_params=warm,
                    profile_params=profiled if profile and not fp8 else None)  # fmt: skip
    if "hf" in args.parts:
        if info.tp_size > 1:
            results["hf"] = {"skipped": "HF generate is the single-GPU reference (--tp 1)"}
        else:
            attempt("hf", lambda: run_hf(policy, prompts, params, args, device, log))
            if "rollout" in results and "tokens_per_s" in results.get("hf", {}):
                results["megatron_over_hf"] = (
                    results["rollout"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
                )
        save()
    if "mcore" in args.parts:
        import mcore_reference

        def reference():
            out = mcore_reference.run(policy, prompts, params, device, log, args.mcore_rows)
            for engine in ("dynamic", "static"):
                if out.get(engine, {}).get("ran"):
                    rows = prompts[: out["rows"]]
                    lengths = [params.max_new_tokens] * len(rows)  # it runs every row to the cap
                    roof = roofline(rows, lengths, counts, ceil, gpus)
                    out[engine]["percent_of_roofline"] = (
                        100 * roof["total_s"] / out[engine]["seconds"]
                    )
            return out

        attempt("mcore", reference)


# ----------------------------------------------------------------------------- whole step


class BenchmarkSampling:
    """Wraps the trainer backend's generate: the benchmark's stop set (or exactly max_new_tokens)
    replaces the recipe's EOS, and every call's rows and wall time are recorded.

    Monkeypatching the loop's sampling is the brief's sanctioned way to give the real step the
    GRPO-shaped stop behaviour: random weights never emit EOS."""

    def __init__(self, generate, device, engine=None):
        self.generate, self.device, self.engine = generate, device, engine
        self.stop_ids: tuple[int, ...] = ()
        self.fixed = False
        self.max_new_tokens: int | None = None  # the part's cap (the recipe's is the largest)
        self.calls: list[dict] = []
        self.lengths: list[list[int]] = []
        self.prompts: list = []

    def __call__(self, prompts, params):
        params = dataclasses.replace(
            params,
            stop_token_ids=() if self.fixed else self.stop_ids,
            ignore_eos=self.fixed,
            max_new_tokens=self.max_new_tokens or params.max_new_tokens,
        )
        _sync(self.device)
        start = time.perf_counter()
        completions = self.generate(prompts, params)
        _sync(self.device)
        seconds = time.perf_counter() - start
        timings = getattr(self.engine, "last_timings", None) or {}
        self.calls.append(
            {
                "seconds": seconds,
                # the engine's own clock (passes, prefill, decode) and the allocator's retries
                # (cudaFree + cudaMalloc again when memory ran short), to place the call's time
                "engine": {k: v for k, v in timings.items() if k != "trace"},
                "alloc_retries": torch.cuda.memory_stats(self.device).get("num_alloc_retries")
                if self.device.type == "cuda"
                else None,
                "prompt_tokens": sum(len(p.token_ids) for p in prompts),
                "unique_prompts": len({id(p) for p in prompts}),
                **length_stats(completions),
            }
        )
        self.lengths.append([len(c.token_ids) for c in completions])
        self.prompts = prompts
        return completions


# step parts: (cap, stop every N tokens or None for exactly the cap)
STEP_PARTS = {"step": ("short", False), "steplong": ("long", False), "fixed256": ("short", True),
              "steplong_partial": ("long", False)}  # fmt: skip


def with_partial_rollouts(t, args) -> None:
    """Trainer `t` from here on with partial rollouts on (rlflow/train/partial.py): the recipe
    says so (TIS under importance_sampling auto), and its rollouts continue unfinished rows."""
    from rlflow.train.partial import PartialRollouts

    gen = t.recipe.generation
    partial = dataclasses.replace(
        gen.partial_rollouts, enabled=True, budget_steps=args.partial_budget,
        max_staleness_steps=args.partial_staleness,
    )  # fmt: skip
    t.recipe = dataclasses.replace(
        t.recipe, generation=dataclasses.replace(gen, partial_rollouts=partial)
    )
    t.context = dataclasses.replace(t.context, recipe=t.recipe)
    t.rollouts = PartialRollouts(t.context)


def run_steps(loaded, samples, stop_sets, args, ceil, counts, run_dir, info, log, out, save):
    """Whole GRPO steps per step part; `out` (results["train"]) is filled and saved after
    every step, so a run cut short keeps the steps it made."""
    from rlflow.data import PromptSampler
    from rlflow.train import loop
    from rlflow.train.setup import setup
    from rlflow.train.update import update_gives_old_logprobs

    start = time.perf_counter()
    t = setup(loaded, run_dir)
    # The GRPO-shaped prompts replace the recipe's dataset: every step draws all of them.
    t.train_data = samples
    t.sampler = PromptSampler(len(samples), len(samples), args.seed)
    # The rollouts read the trainer's RolloutContext (rlflow/train/collect.py): hand them the
    # same data and sampler, or they would draw the recipe's own dataset.
    t.context = dataclasses.replace(t.context, train_data=samples, sampler=t.sampler)
    t.rollouts.context = t.context
    sampling = BenchmarkSampling(t.backend.generate, info.device, t.backend)
    t.backend.generate = sampling
    loop._resume_or_start(t)  # what loop.train does first: optimizer, reference = policy
    log(f"step: trainer built in {time.perf_counter() - start:.1f} s")
    gpus = info.world_size
    rate = ceil["matmul_tflop_s"] * 1e12 * gpus
    # forward passes in the logprobs phase: the reference's, and the policy's unless the update's
    # own forward gives the old logprobs (one mini-batch: rlflow.train.update)
    passes = (t.reference is not None) + (
        not update_gives_old_logprobs(t.recipe.grpo.num_minibatches)
    )
    out.update(trainer_build_s=time.perf_counter() - start, logprob_passes=passes)
    for part in [p for p in args.parts if p in STEP_PARTS]:
        workload, sampling.fixed = STEP_PARTS[part]
        sampling.stop_ids, sampling.max_new_tokens = stop_sets[workload]
        partial = part == "steplong_partial"
        if partial:  # the row cap is the recipe's (the long cap); each call's is the budget
            with_partial_rollouts(t, args)
            sampling.max_new_tokens = None
        rows = []
        for index in range(args.partial_steps if partial else args.steps):
            calls_before = len(sampling.calls)
            step = t.step + 1
            # --ab-logprob-pass: after the first step, odd steps run the separate old-logprob
            # pass as before (the A/B reference in the same process), even steps skip it
            recompute = args.ab_logprob_pass and index % 2 == 1
            loop.update_gives_old_logprobs = (
                (lambda n: False) if recompute else update_gives_old_logprobs
            )
            metrics = loop.grpo_step(t, step)
            t.step = step
            t.log.log(step, metrics)
            call = sampling.calls[-1]
            tokens = call["prompt_tokens"] + call["useful_tokens"]
            if partial:  # several calls (rounds) of continuations: count what trained
                calls = sampling.calls[calls_before:]
                tokens = int(metrics["train/real_tokens"])
                call = {**call, "seconds": sum(c["seconds"] for c in calls),
                        "useful_tokens": sum(c["useful_tokens"] for c in calls),
                        "mean_response": metrics["train/response_length"]}  # fmt: skip
            timing = {k: v for k, v in metrics.items() if k.startswith("time/")}
            row = {
                "step": step,
                "old_logprob_pass": recompute
                or not update_gives_old_logprobs(t.recipe.grpo.num_minibatches),
                **timing,
                "tokens": tokens,
                "response_mean": call["mean_response"],
                "generate_s": call["seconds"],
                "generate_engine": call["engine"],
                "alloc_retries": call["alloc_retries"],
                "generation_tokens_per_s": call["useful_tokens"] / call["seconds"],
                "tokens_per_s_per_gpu": tokens / metrics["time/step"] / gpus,
                "update_mfu": 6
                * counts["lm_matmul_params"]
                * tokens
                / metrics["time/training"]
                / rate,
                "logprob_mfu": 2
                * counts["lm_matmul_params"]
                * tokens
                * (passes + recompute)
                / max(metrics["time/logprobs"], 1e-9)
                / rate,
                **{
                    k: v
                    for k, v in metrics.items()
                    if k.startswith(("memory/", "speed/", "partial/"))
                },  # fmt: skip
                "token_mult_prob_error": metrics.get("train/token_mult_prob_error"),
                "generation_percent_of_roofline": 100
                * roofline(sampling.prompts, sampling.lengths[-1], counts, ceil, gpus)["total_s"]
                / call["seconds"],
            }
            rows.append(row)
            out[part] = {"steps": rows}
            save()
            log(
                f"{part} {step}{' (old-logprob pass)' if row['old_logprob_pass'] else ''}: "
                f"{row['time/step']:.1f} s (generation "
                f"{row.get('time/generation', 0):.1f}, logprobs {row.get('time/logprobs', 0):.1f},"
                f" training {row.get('time/training', 0):.1f}), {tokens} tokens, "
                f"{row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, MFU update "
                f"{100 * row['update_mfu']:.1f}% logprobs {100 * row['logprob_mfu']:.1f}%, "
                f"allocated {row.get('memory/allocated_gib', float('nan')):.2f} GiB"
            )
        later = rows[1:] or rows  # step 1 includes CUDA-graph capture and compilation
        if partial:  # the first steps fill the pipeline of rows in flight
            later = rows[len(rows) // 2 :]
        summary = {
            key: statistics.median(r[key] for r in later)
            for key, value in rows[0].items()
            if key != "step"
            and isinstance(value, int | float)  # (the engine's timings are a dict per step)
            and key.startswith(
                ("time/", "speed/", "tokens", "response", "generat", "update", "logprob")
            )
        }
        if args.ab_logprob_pass:  # medians of each arm, first step left out
            for arm, wanted in (("with_old_logprob_pass", True), ("without", False)):
                picked = [r for r in later if r["old_logprob_pass"] == wanted]
                summary[arm] = {
                    key: statistics.median(r[key] for r in picked)
                    for key in ("time/step", "time/logprobs", "time/training",
                                "time/generation", "tokens_per_s_per_gpu")
                    if picked
                }  # fmt: skip
        summary["allocated_gib_per_step"] = [r.get("memory/allocated_gib") for r in rows]
        summary["peak_gib_per_step"] = [r.get("memory/peak_gib") for r in rows]
        if partial:  # over the steps summarised: all their tokens / all their time
            seconds = sum(r["time/step"] for r in later)
            summary["tokens_per_s_per_gpu_overall"] = (
                sum(r["tokens"] for r in later) / seconds / gpus
            )
            summary["steps_summarised"] = [r["step"] for r in later]
        out[part] = {"median_of_steps_2_on": summary, "steps": rows}
    t.backend.close()
    t.log.close()
    metrics_file = run_dir / "metrics.jsonl"
    if info.is_main and metrics_file.exists():
        shutil.copy(metrics_file, args.out / "metrics.jsonl")


# ----------------------------------------------------------------------------- driver


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results")
    parser.add_argument("--tiny", action="store_true", help="tiny model, fp32: CPU smoke test")
    parser.add_argument(
        "--model",
        choices=("qwen25vl-3b", "qwen3vl-4b", "qwen25vl", "qwen3vl"),
        default="qwen25vl-3b",
        help="the random checkpoint's shape (init-tiny-model's preset); with --tiny, that "
        "family's tiny model (qwen25vl / qwen3vl name the same)",
    )
    parser.add_argument("--parts", default="rollout,long,fixed,hf,mcore,steplong,step")
    parser.add_argument("--prompts", type=int, default=None, help="unique prompts (64; tiny 4)")
    parser.add_argument("--samples", type=int, default=None, help="rollouts per prompt (8; 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="cap (256; tiny 16)")
    parser.add_argument("--stop-every", type=int, default=80, help="stop set = vocab / this")
    parser.add_argument("--long-max-new-tokens", type=int, default=None, help="long cap (4096)")
    parser.add_argument("--long-stop-every", type=int, default=None, help="long stops (1000)")
    parser.add_argument(
        "--variants", default="bf16", help="engine variants of the rollout parts: bf16,fp8"
    )
    parser.add_argument(
        "--fp8-parts", default="rollout,long,fixed", help="rollout parts the fp8 variant runs"
    )
    parser.add_argument("--mcore-rows", type=int, default=64, help="rows megatron-core runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=2, help="timed rollout calls (median)")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=0,
        help="generation.max_batch_size: 0 (the recipes' default) lets the engine size its pass "
        "from free memory; 512 or 128 cap it",
    )
    parser.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="MegatronGeneration compile_decode (default: on, off with --tiny)",
    )
    parser.add_argument("--hf-prompts", type=int, default=4, help="prompts HF generate runs on")
    parser.add_argument("--hf-batch", type=int, default=32, help="HF generate chunk size")
    parser.add_argument("--hf-reps", type=int, default=2, help="timed HF calls (median)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per part (5; tiny 2)")
    parser.add_argument(
        "--partial-steps",
        type=int,
        default=None,
        help="steps of steplong_partial (--steps; the later half is summarised)",
    )
    parser.add_argument(
        "--partial-budget",
        type=int,
        default=None,
        help="steplong_partial: decode steps per step (1024; tiny 16)",
    )
    parser.add_argument("--partial-staleness", type=int, default=4,
                        help="steplong_partial: max_staleness_steps")  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (= GPUs)")
    parser.add_argument("--ab-logprob-pass", action="store_true",
                        help="steps after the first alternate: with the separate old-logprob "
                        "pass (as before), without it (one mini-batch's default)")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="profile one more rollout call")
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra recipe override for the step parts (repeatable)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="random checkpoint folder (default $TMPDIR/rlflow-bench-3b, as the other benchmarks;"
        " qwen3vl-4b: rlflow-bench-qwen3vl-4b)",
    )
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.model = {"qwen25vl": "qwen25vl-3b", "qwen3vl": "qwen3vl-4b"}.get(args.model, args.model)
    args.prompts = args.prompts or (4 if tiny else 64)
    args.samples = args.samples or (2 if tiny else 8)
    args.max_new_tokens = args.max_new_tokens or (16 if tiny else 256)
    args.steps = args.steps or (2 if tiny else 5)
    args.partial_steps = args.partial_steps or args.steps
    args.partial_budget = args.partial_budget or (16 if tiny else 1024)
    args.hf_prompts = min(args.hf_prompts, args.prompts)
    if args.compile_decode is None:
        args.compile_decode = not tiny
    args.long_max_new_tokens = args.long_max_new_tokens or (48 if tiny else 4096)
    args.long_stop_every = args.long_stop_every or (12 if tiny else 1000)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    known = sorted(ROLLOUT_PARTS | set(STEP_PARTS))
    unknown = sorted(set(args.parts) - set(known))
    if unknown:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown)}; use {','.join(known)}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(args.variants) - {"bf16", "fp8"}:
        parser.error("--variants: bf16 and/or fp8")
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    names = {  # the other benchmarks' folder names for the Qwen2.5-VL ones
        ("qwen25vl-3b", True): "rlflow-bench-tiny",
        ("qwen25vl-3b", False): "rlflow-bench-3b",
        ("qwen3vl-4b", True): "rlflow-bench-tiny-qwen3vl",
        ("qwen3vl-4b", False): "rlflow-bench-qwen3vl-4b",
    }
    args.checkpoint = args.checkpoint or tmp / names[args.model, tiny]
    return args


def recipe_overrides(args, checkpoint: Path) -> list[str]:
    tiny = args.tiny
    long = {"steplong", "steplong_partial"} & set(args.parts)
    cap = args.long_max_new_tokens if long else args.max_new_tokens
    return [
        f"model.checkpoint={checkpoint}",
        f"model.dtype={'float32' if tiny else 'bfloat16'}",
        f"parallelism.tensor_parallel_size={args.tp}",
        f"grpo.num_prompts_per_step={args.prompts}",
        f"grpo.num_generations_per_prompt={args.samples}",
        f"grpo.max_num_steps={10 * args.steps + 10}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.dynamic_sampling.enabled=false",  # random weights: every group's rewards are equal
        "generation.temperature=1.0",
        f"generation.max_new_tokens={cap}",
        f"generation.max_batch_size={args.max_batch_size}",
        f"generation.compile_decode={str(args.compile_decode).lower()}",
        "data.max_prompt_tokens=2048",
        f"data.video.num_frames={VIDEO_FRAMES}",
        "data.video.temporal_patch_size=2",
        "data.video.fps=2.0",
        "checkpointing.enabled=false",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        *args.override,
    ]


def rank_main(args) -> None:
    from rlflow import parallel
    from rlflow.compat import library_logs
    from rlflow.rules import load_checked

    library_logs.quiet()
    began = time.perf_counter()
    loaded = load_checked(args.recipe, recipe_overrides(args, args.checkpoint))
    info = parallel.init_parallel(
        loaded.recipe.parallelism,
        args.seed,
        timeout_s=loaded.recipe.watchdog.collective_timeout_s,
        placement=None,
    )
    device = info.device

    def log(message: str) -> None:
        if info.is_main:
            print(f"[{time.perf_counter() - began:6.1f} s] {message}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpus": info.world_size if device.type == "cuda" else 0,
        "tensor_parallel": info.tp_size,
        "torch": torch.__version__,
        "argv": sys.argv[1:],
        "model_preset": ("tiny " if args.tiny else "") + args.model,
        "workload": {
            "prompts": args.prompts,
            "samples": args.samples,
            "max_new_tokens": args.max_new_tokens,
            "stop_every": args.stop_every,
            "seed": args.seed,
            "max_batch_size": args.max_batch_size,
            "compile_decode": args.compile_decode,
        },
    }

    def save() -> None:
        if info.is_main:
            (args.out / RESULTS).write_text(json.dumps(results, indent=2, default=_plain))

    start = time.perf_counter()
    checkpoint = bench_checkpoint(args.checkpoint, args.tiny, device, info.is_main, args.model)
    parallel.barrier()
    results["checkpoint_s"] = time.perf_counter() - start
    loaded = load_checked(args.recipe, recipe_overrides(args, checkpoint))
    dtype_bytes = 4 if args.tiny else 2
    counts = model_counts(checkpoint, dtype_bytes)
    results["model"] = counts
    results["ceilings"] = ceil = ceilings(device)
    log(
        f"checkpoint {checkpoint} ({counts['model_type']}: {counts['total_params']:,} params, LM "
        f"{counts['lm_params']:,}, vision {counts['vision_params']:,}); ceilings {json.dumps(ceil)}"
    )

    from rlflow.generation.base import SamplingParams
    from rlflow.model.processor import PromptEncoder

    encoder = PromptEncoder(checkpoint, loaded.recipe.data)
    args.pad_token_id = encoder.pad_token_id
    samples = make_samples(args.prompts, args.seed, encoder.tokenizer)
    unique = [encoder.encode(s) for s in samples]
    prompts = [p for p in unique for _ in range(args.samples)]  # the same object G times
    stop_ids = stop_token_ids(counts["vocab_size"], args.stop_every, args.seed)
    long_stop_ids = stop_token_ids(counts["vocab_size"], args.long_stop_every, args.seed)
    media_ids = {counts["image_token_id"], counts["video_token_id"]}
    visual: dict[str, set[int]] = {}  # visual tokens per kind of row
    for s, p in zip(samples, unique):
        visual.setdefault(s.kind, set()).add(sum(t in media_ids for t in p.token_ids))
    lengths = [len(p.token_ids) for p in unique]
    results["workload"].update(
        rows=len(prompts),
        kinds={k: sum(s.kind == k for s in samples) for k in sorted(visual)},
        visual_tokens={k: sorted(v) for k, v in sorted(visual.items())},
        stop_set_size=len(stop_ids),
        prompt_tokens_min=min(lengths),
        prompt_tokens_mean=statistics.mean(lengths),
        prompt_tokens_max=max(lengths),
        prompt_tokens_unique_total=sum(lengths),
    )
    save()
    log(f"workload {json.dumps(results['workload'])}")
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        seed=args.seed,
        stop_token_ids=stop_ids,
        ignore_eos=False,
    )

    long_params = dataclasses.replace(
        params, max_new_tokens=args.long_max_new_tokens, stop_token_ids=long_stop_ids
    )
    if ROLLOUT_PARTS & set(args.parts):
        from rlflow.model.build import load_policy

        start = time.perf_counter()
        policy = load_policy(
            checkpoint, loaded.recipe.model, loaded.recipe.parallelism, trainable=False
        )
        results["load_policy_s"] = time.perf_counter() - start
        log(f"policy loaded in {results['load_policy_s']:.1f} s")
        run_rollout_parts(policy, prompts, params, long_params, samples, encoder, args, ceil,
                          counts, info, device, log, results, save)  # fmt: skip
        del policy
        _free(device)

    if set(STEP_PARTS) & set(args.parts):
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()  # setup() initialises it again (same world)
        run_dir = Path(
            parallel.broadcast_object(
                tempfile.mkdtemp(prefix="rlflow-bench-grpo-shaped-") if info.is_main else None
            )
        )
        try:
            stop_sets = {
                "short": (stop_ids, args.max_new_tokens),
                "long": (long_stop_ids, args.long_max_new_tokens),
            }
            results["train"] = {}
            run_steps(loaded, samples, stop_sets, args, ceil, counts, run_dir, info, log,
                      results["train"], save)  # fmt: skip
        finally:
            parallel.barrier()
            if info.is_main:
                shutil.rmtree(run_dir, ignore_errors=True)
        save()
    save()
    if info.is_main:
        print_summary(results)
    parallel.shutdown()


def print_summary(results: dict) -> None:
    print("\n== GRPO-shaped benchmark ==", flush=True)
    for key, roll in results.items():
        if not key.startswith(("rollout", "long", "fixed")) or not isinstance(roll, dict):
            continue
        if "failed" in roll:
            print(f"{key}: FAILED {roll['failed'][:200]}")
            continue
        roof, run = roll["roofline"], roll["runs"][0]
        print(
            f"{key}: {roll['tokens_per_s']:,.0f} useful tok/s, {roll['percent_of_roofline']:.1f}%"
            f" of its roofline ({roof['tokens_per_s']:,.0f} tok/s); mean response "
            f"{run['mean_response']:.1f} (max {run['max_response']}, {run['rows_at_cap']} at the "
            f"cap); {roll['seconds']:.2f} s per call, prefill {run['prefill_s']:.3f} s vs "
            f"{roof['prefill_s']:.3f} s; peak {roll['peak_gib']:.1f} GiB"
        )
    hf = results.get("hf")
    if hf and "tokens_per_s" in hf:
        note = " (subset; full batch extrapolated)" if hf["extrapolated"] else ""
        print(
            f"hf generate: {hf['tokens_per_s']:,.0f} useful tok/s on {hf['measured_rows']} rows"
            f"{note}: ~{hf['estimated_full_batch_s']:.1f} s for all {hf['full_rows']}; "
            f"megatron / hf = {results.get('megatron_over_hf', float('nan')):.2f}x"
        )
    for engine in ("dynamic", "static"):
        ref = results.get("mcore", {}).get(engine)
        if ref:
            what = (f"{ref['tokens_per_s']:,.0f} tok/s" if ref.get("ran")
                    else f"cannot run: {ref['error'][:160]} ({ref.get('where')})")  # fmt: skip
            print(f"megatron-core {engine} engine: {what}")
    for part in STEP_PARTS:
        s = results.get("train", {}).get(part, {}).get("median_of_steps_2_on")
        if s:
            print(
                f"{part}: {s['time/step']:.1f} s/step (generation {s.get('time/generation', 0):.1f},"
                f" logprobs {s.get('time/logprobs', 0):.1f}, training "
                f"{s.get('time/training', 0):.1f}); {s['tokens_per_s_per_gpu']:,.0f} tok/s/GPU; "
                f"MFU update {100 * s['update_mfu']:.1f}% logprobs {100 * s['logprob_mfu']:.1f}%;"
                f" generation {s.get('generation_percent_of_roofline', 0):.1f}% of roofline; "
                f"peak GiB per step {s['peak_gib_per_step']}"
            )


def launch_ranks(args) -> int:
    """--tp N: N local ranks through rlflow's own launcher (`rlflow train --nproc`'s); rank 0's
    log is echoed here as it grows."""
    from rlflow.job.local import run_local

    args.out.mkdir(parents=True, exist_ok=True)
    log_file = args.out / "logs" / "rank-0.log"
    done = threading.Event()

    def echo() -> None:
        position = 0
        while not done.is_set() or (log_file.exists() and log_file.stat().st_size > position):
            if log_file.exists():
                with log_file.open("rb") as f:
                    f.seek(position)
                    chunk = f.read()
                    position += len(chunk)
                    sys.stdout.write(chunk.decode(errors="replace"))
                    sys.stdout.flush()
            time.sleep(0.5)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    try:
        return run_local(
            [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]],
            args.tp,
            args.out,
            startup_timeout=None,  # the benchmark's ranks report no progress
            stop_signal="USR1",
        )
    finally:
        done.set()
        thread.join(timeout=5)


def main() -> None:
    args = parse_args()
    if args.tp > 1 and "RANK" not in os.environ:
        sys.exit(launch_ranks(args))
    rank_main(args)


def _plain(value):
    """JSON for numpy / torch scalars (and a readable string for anything else)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> float:
    return (
        torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    )


def _allocated(device) -> float:
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def _free(device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
