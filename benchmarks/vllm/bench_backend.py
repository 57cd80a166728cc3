"""vLLM backend on the tiny model (CPU, fp32): start-up, parity with Megatron/HF, generate and refresh time.

Usage (repository root; the vLLM environment built by `rlflow setup-env vllm`):

    uv run python benchmarks/vllm/bench_backend.py [--reps 5]

Writes benchmarks/vllm/backend_bench.json and prints it. Times are wall-clock on whatever else
the machine is doing; the file records the load average next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))  # tests.tiny: the prompts of each media kind the tests use


def timed(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def parity(ours, reference) -> dict:
    same = sum(a.token_ids == b.token_ids for a, b in zip(ours, reference, strict=True))
    gap = max(
        abs(x - y)
        for a, b in zip(ours, reference, strict=True)
        for x, y in zip(a.logprobs, b.logprobs, strict=False)
    )
    return {"rows_identical": f"{same}/{len(ours)}", "max_abs_logprob_diff": gap}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoProcessor

    from rlflow.compat import library_logs
    from rlflow.generation.base import SamplingParams
    from rlflow.generation.hf import HFGeneration
    from rlflow.generation.megatron.engine import MegatronGeneration
    from rlflow.generation.vllm.client import VLLMGeneration
    from rlflow.model.build import load_policy
    from rlflow.rules import load_checked
    from tests.tiny import FP32, SINGLE, init_single_rank, make_prompt, tiny_checkpoint

    library_logs.quiet()
    init_single_rank()
    work = Path(tempfile.mkdtemp(prefix="rlflow-vllm-bench-"))
    checkpoint = tiny_checkpoint(str(work))
    policy = load_policy(checkpoint, FP32, SINGLE, trainable=False)
    processor = AutoProcessor.from_pretrained(str(checkpoint))
    recipe = load_checked(
        ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml", ["generation.backend=vllm"]
    ).recipe
    kinds = [
        ("image", "How many red squares are there?"),
        ("text", "How many?"),
        ("video", "How many objects appear in the video?"),
        ("image", "Count the circles."),
    ]
    mixed = [
        make_prompt(processor, kind, question, seed=i) for i, (kind, question) in enumerate(kinds)
    ]
    eos, pad = processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id

    start = time.perf_counter()
    vllm = VLLMGeneration(policy, recipe.generation, work / "run", max_model_len=1024)
    startup = time.perf_counter() - start
    megatron = MegatronGeneration(
        policy, pad, max_batch_size=64, cuda_graphs=True, compile_decode=False,
        share_prompts=True, fp8=False, release_cache=False, cache_tokens=0,
    )  # fmt: skip
    hf = HFGeneration(policy, pad, 64)
    greedy = SamplingParams(24, 0.0, 1.0, 0, 0, (eos,), True)
    ours = vllm.generate(mixed, greedy)
    result = {
        "vs_megatron": parity(ours, megatron.generate(mixed, greedy)),
        "vs_hf": parity(ours, hf.generate(mixed, greedy)),
    }

    rollouts = [p for p in mixed for _ in range(16)]  # 64 rollouts, as a tiny-recipe GRPO step
    sampled = SamplingParams(8, 1.0, 1.0, 0, 1, (eos,), True)
    vllm.generate(rollouts, sampled)  # warm-up
    megatron.generate(rollouts, sampled)
    gen_vllm, _ = timed(lambda: vllm.generate(rollouts, sampled), args.reps)
    gen_megatron, _ = timed(lambda: megatron.generate(rollouts, sampled), args.reps)
    refresh, _ = timed(vllm.refresh_weights, args.reps)
    vllm.close()
    doc = {
        "command": "uv run python benchmarks/vllm/bench_backend.py " + " ".join(sys.argv[1:]),
        "model": "tiny Qwen2.5-VL (rlflow.model.tiny, lm_head_scale 8), fp32, CPU",
        "vllm": vllm.worker.info.get("vllm_version"),
        "load_average_1m_at_end": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "worker_startup_s": round(startup, 2),
        "worker_ready_s": round(vllm.worker.info["startup_seconds"], 2),
        "parity_greedy_24_tokens_image_text_video_image": result,
        "generate_64_rollouts_8_tokens_s": {
            "vllm": round(gen_vllm, 3),
            "megatron": round(gen_megatron, 3),
        },
        "refresh_weights_s_median": round(refresh, 4),
    }
    (HERE / "backend_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
