"""The trainer's passes on a GRPO-shaped batch: padded vs packed vs packed with token budgets.

Workload: the GRPO-shaped prompts of benchmarks/grpo_shaped.py (64 prompts x 8 samples, images
at four resolutions, videos, text rows, ragged questions) on the random Qwen2.5-VL-3B-shaped
checkpoint in bf16. Responses are seeded random tokens with geometric lengths (mean --mean-response,
capped at --max-new-tokens), so no generation is needed. For each configuration:

- logprobs: one `rollout_logprobs` pass (no grad, with entropy, as the policy pass);
- update:   one `grpo_update` (2 mini-batches, lr 0 so the weights stay as they are);
- real tokens/s and MFU, counting only prompt + response tokens (2 x LM matmul params x tokens for
  the logprob pass, 6 x for the update, / measured bf16 matmul rate): padding counts against it;
- peak memory;
- packed vs padded logprobs on the generated tokens (max and mean |diff|, bf16).

With model.freeze_vision the vision cache is on and cleared before every timed pass, so each pass
runs the tower once per prompt, as the first pass of a step does.

    # one H200 (PYTHONPATH as for the other GPU benchmarks)
    python3 benchmarks/trainer_packing.py --out $OUT
    # CPU smoke test (tiny model, fp32, 4 prompts x 2 samples)
    uv run python benchmarks/trainer_packing.py --tiny --out /tmp/trainer-packing
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_shaped import (  # noqa: E402
    VIDEO_FRAMES,
    bench_checkpoint,
    ceilings,
    make_samples,
    model_counts,
)

RECIPE = ROOT / "recipes" / "vlm_grpo-qwen25vl-3b-clevr-4n8g-megatron-tp2.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny model in fp32 (CPU smoke test)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--mean-response", type=float, default=80.0)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument(
        "--budgets", default="8192,16384,32768", help="token budgets of the packed runs"
    )
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions (after a warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tiny:
        args.prompts, args.samples, args.max_new_tokens, args.mean_response = 4, 2, 16, 6.0
        args.budgets, args.reps = "200", 1
    return args


def rollout_batch(encoder, policy, args):
    """The GRPO-shaped prompts, G rows each (one Prompt object per group), random responses."""
    from rlflow.generation.base import Completion
    from rlflow.train.rollouts import build_train_batch

    samples = make_samples(args.prompts, args.seed, encoder.tokenizer)
    prompts = [encoder.encode(s) for s in samples]
    rows = [p for p in prompts for _ in range(args.samples)]
    generator = torch.Generator().manual_seed(args.seed)
    vocab = encoder.tokenizer.vocab_size
    p_stop = 1.0 / args.mean_response
    completions = []
    for _ in rows:
        n = 1
        while n < args.max_new_tokens and float(torch.rand((), generator=generator)) > p_stop:
            n += 1
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        completions.append(Completion(ids, [0.0] * n, "length"))
    advantages = torch.randn(len(rows), generator=generator).tolist()
    media = policy.media_tokens
    return build_train_batch(
        rows,
        completions,
        advantages,
        media.image,
        media.video,
        media.merge_size,
        encoder.pad_token_id,
    )


def timed(fn, device, reps: int) -> tuple[float, object, float]:
    """Median seconds of `reps` calls after one warm-up; the last result; peak GiB."""
    fn()
    seconds, result = [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return statistics.median(seconds), result, peak


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from rlflow import parallel
    from rlflow.model import library_logs
    from rlflow.model.build import load_policy
    from rlflow.model.processor import PromptEncoder
    from rlflow.recipe.load import load_recipe
    from rlflow.train.setup import share_vision_cache
    from rlflow.train.update import Optimizer, grpo_update, micro_batches, rollout_logprobs

    library_logs.quiet()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = Path("/tmp/rlflow-bench") / ("tiny" if args.tiny else "qwen25vl-3b")
    checkpoint = bench_checkpoint(base, args.tiny, device, is_writer=True)
    overrides = [
        f"model.checkpoint={checkpoint}",
        f"model.dtype={'float32' if args.tiny else 'bfloat16'}",
        "parallelism.tensor_parallel_size=1",
        "grpo.num_minibatches=2",
        "data.max_prompt_tokens=2048",
        f"data.video.num_frames={VIDEO_FRAMES}",
        "data.video.temporal_patch_size=2",
        "data.video.fps=2.0",
    ]
    recipe = load_recipe(RECIPE, overrides).recipe
    info = parallel.init_parallel(recipe.parallelism, seed=args.seed)
    policy = load_policy(checkpoint, recipe.model, recipe.parallelism, trainable=True)
    share_vision_cache(policy, None, enabled=recipe.model.freeze_vision)
    cache = policy.extra["vision_cache"]
    encoder = PromptEncoder(checkpoint, recipe.data)
    batch = rollout_batch(encoder, policy, args)
    lengths = batch.lengths
    real_tokens = sum(lengths)
    counts = model_counts(checkpoint, 2)
    rate = ceilings(device)["matmul_tflop_s"] * 1e12
    optimizer = Optimizer.create(policy, 0.0, 0.0, 0.9, 0.999, 1e-8, 0.0)
    workload = {
        "rollouts": len(batch),
        "real_tokens": real_tokens,
        "response_tokens": int(batch.target_mask.sum()),
        "longest_row": max(lengths),
        "padded_tokens_at_micro_batch_size": sum(
            len(g) * max(lengths[i] for i in g)
            for g in micro_batches(lengths, args.micro_batch_size)
        ),
        "lm_matmul_params": counts["lm_matmul_params"],
        "matmul_tflop_s": rate / 1e12,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    print(json.dumps(workload), flush=True)
    configs = [("padded", False, 0), ("packed", True, 0)]
    configs += [(f"packed_budget_{b}", True, int(b)) for b in args.budgets.split(",")]
    results, reference = {}, None
    for name, packed, budget in configs:
        keywords = {"max_tokens_per_micro_batch": budget, "sequence_packing": packed}
        plan = micro_batches(lengths, args.micro_batch_size, budget, packed)

        def logprob_pass(keywords=keywords):
            cache.clear()
            return rollout_logprobs(policy, batch, args.micro_batch_size, True, **keywords)

        def update(keywords=keywords):
            cache.clear()
            old = torch.zeros_like(batch.gen_logprobs)
            return grpo_update(
                policy, optimizer, batch, old, None, recipe.loss, args.micro_batch_size, 2,
                **keywords,
            )  # fmt: skip

        lp_s, (logprobs, _), lp_peak = timed(logprob_pass, device, args.reps)
        up_s, _, up_peak = timed(update, device, args.reps)
        mask = batch.target_mask
        if reference is None:
            reference = logprobs
        diff = (logprobs - reference).abs()[mask]
        results[name] = {
            "micro_batches": len(plan),
            "logprobs_s": lp_s,
            "logprobs_tokens_per_s": real_tokens / lp_s,
            "logprobs_mfu": 2 * counts["lm_matmul_params"] * real_tokens / lp_s / rate,
            "logprobs_peak_gib": lp_peak,
            "update_s": up_s,
            "update_tokens_per_s": real_tokens / up_s,
            "update_mfu": 6 * counts["lm_matmul_params"] * real_tokens / up_s / rate,
            "update_peak_gib": up_peak,
            "vs_padded_max_abs_diff": float(diff.max()),
            "vs_padded_mean_abs_diff": float(diff.mean()),
        }
        print(name, json.dumps(results[name]), flush=True)
    out = {"command": sys.argv, "workload": workload, "results": results}
    (args.out / "trainer_packing.json").write_text(json.dumps(out, indent=2))
    del info


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
