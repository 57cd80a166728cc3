"""Asynchronous GRPO (issue 19, item 8): the weight-sync time, and synchronous against
one-step-off GRPO at the same placement budget.

Parts (--parts, any subset):
- sync:    the trainer -> generation weight sync between two processes (1 training rank, 1
           generation rank through rlflow's local launcher), exactly as the trainer runs it
           (rlflow.train.generation_role.weight_sync.WeightSync: bucketed broadcasts, then the fingerprint
           check), on the Qwen2.5-VL-3B language model's tensors (random, megatron's names and
           partitioning; --layers of its 36 decoder layers, the embedding (tied to the output
           layer, as in the 3B) and the final norm; a frozen vision tower is not synced). NCCL
           on two GPUs; on one GPU --backend gloo stages through host memory (NCCL refuses two
           ranks on one device); gloo on CPU. The median of --reps syncs after one warm-up.
- reshard: in one process on one device, the receiving side's compute of a sync: the same
           tensors as --train-tp trainer shards copied into a TP-1 generation engine, and both
           sides' fingerprints compared (plus one torn element, which must be detected).
- steps:   whole `rlflow train` runs of the 3B recipe (random weights from `rlflow
           init-tiny-model --preset qwen25vl-3b`, bf16), long responses: max_new_tokens 1024 and
           random weights almost never sample EOS, so the mean response is ~1k tokens. Two runs
           at the same budget of --gpus GPUs: colocated (every GPU trains and generates, data
           parallel --gpus) against separate one-step-off (--gpus/2 generate, --gpus/2 train).
           Medians of time/* over steps 2..N, the speed-up in s/step and rollouts/s. Needs
           --gpus >= 2 (issue 22).

Results: one JSON file per invocation, `<--out>/async_grpo_results.json`: the command, the
workload, the host, and per part its numbers (layout and numbers: benchmarks/async_grpo.md).

    # CPU, this machine: the sync between two processes and the reshard (4 of 36 layers), and
    # a smoke test of the steps part on the tiny recipe (2 ranks per mode, 3 steps)
    uv run python benchmarks/async_grpo.py --parts sync,reshard --layers 4 --out /tmp/ab
    uv run python benchmarks/async_grpo.py --parts steps --tiny --steps 3 --out /tmp/ab
    # one GPU (device tool, wheels carried in .whl/, as in generation_throughput.md): the full
    # 3B sync through host memory, and the reshard + fingerprint on the GPU (about 2 minutes)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/async_grpo.py --parts sync,reshard \
        --backend gloo --out $OUT
    # two or more GPUs (issue 22): NCCL sync, then colocated DP=2 against 1 + 1 one-step-off
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/async_grpo.py --parts sync,reshard,steps \
        --gpus 2 --steps 6 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = "async_grpo_results.json"
RECIPE_3B = ROOT / "recipes" / "vlm_grpo-qwen25vl-3b-clevr-4n8g-megatron-tp2.yaml"
RECIPE_TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
# Qwen2.5-VL-3B's language model (rlflow.model.tiny.PRESETS["qwen25vl-3b"])
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 2048, 11008, 36, 16, 2, 151936
SEPARATE = ["generation.placement=separate", "async_grpo.max_staleness=1"]


# ---------------------------------------------------------------- part sync


def lm_tensors(layers: int) -> list[tuple[str, tuple[int, ...], int | None, int]]:
    """(name, shape, partition dim, stride) of the 3B language model, megatron-core's names."""
    head = HIDDEN // HEADS
    qkv = (HEADS + 2 * KV_HEADS) * head
    out = [("embedding.word_embeddings.weight", (VOCAB, HIDDEN), 0, 1)]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out += [
            (p + "self_attention.linear_qkv.layer_norm_weight", (HIDDEN,), None, 1),
            (p + "self_attention.linear_qkv.weight", (qkv, HIDDEN), 0, 1),
            (p + "self_attention.linear_qkv.bias", (qkv,), 0, 1),
            (p + "self_attention.linear_proj.weight", (HIDDEN, HIDDEN), 1, 1),
            (p + "mlp.linear_fc1.layer_norm_weight", (HIDDEN,), None, 1),
            (p + "mlp.linear_fc1.weight", (2 * FFN, HIDDEN), 0, 2),
            (p + "mlp.linear_fc2.weight", (HIDDEN, FFN), 1, 1),
        ]
    return out + [("decoder.final_layernorm.weight", (HIDDEN,), None, 1)]


class FakePolicy:
    """What WeightSync reads of a policy (`core.named_parameters()`), without a model build."""

    def __init__(self, tensors, device, dtype):
        import torch

        self.core = torch.nn.Module()
        for name, shape, dim, stride in tensors:
            module = self.core
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            param = torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device))
            if dim is not None:
                param.tensor_model_parallel, param.partition_dim = True, dim
                param.partition_stride = stride
            module.register_parameter(leaf, param)


def sync_rank(args) -> None:
    """One rank of the sync part: rank 0 trains (sends), rank 1 generates (receives)."""
    import torch

    from rlflow import parallel
    from rlflow.recipe.placement import Placement
    from rlflow.recipe.schema import ParallelismConfig
    from rlflow.train.generation_role.weight_sync import WeightSync, synced_layouts

    if args.backend == "gloo" and torch.cuda.is_available():
        parallel.CROSS_DEVICE_BACKEND = "gloo"  # set before init: both ranks share one GPU
    info = parallel.init_parallel(
        ParallelismConfig(1, 1, 1, 1, "off"), 0, timeout_s=600, placement=Placement((0,), (1,))
    )
    dtype = torch.bfloat16 if info.device.type == "cuda" or args.bf16 else torch.float32
    torch.manual_seed(info.job_rank)  # different weights on the two sides: the sync must copy
    policy = FakePolicy(lm_tensors(args.layers), info.device, dtype)
    layouts = parallel.job_group().broadcast_object(
        synced_layouts(policy, 1) if info.job_rank == 0 else None, src=0
    )
    sync = WeightSync(policy, layouts, args.bucket_mb)
    nbytes = sum(p.numel() * p.element_size() for p in policy.core.parameters())
    seconds = []
    for version in range(args.reps + 1):
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        parallel.job_group().all_gather_object(None)  # both sides start together
        start = time.perf_counter()
        sync.run(version)
        sync.verify(version)  # raises on job rank 0 if the copy is wrong
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    if info.job_rank == 0:
        median = statistics.median(seconds[1:])
        row = {
            "backend": args.backend if info.device.type == "cuda" else "gloo",
            "device": torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."),
            "layers": args.layers,
            "tensors": len(layouts),
            "gb": nbytes / 1e9,
            "buckets": len(sync.buckets),
            "bucket_mb": args.bucket_mb,
            "seconds": seconds,
            "median_s": median,
            "gb_per_s": nbytes / 1e9 / median,
            "full_3b_gb": full_3b_bytes(dtype) / 1e9,
            "full_3b_s_at_this_rate": full_3b_bytes(dtype) / (nbytes / median),
        }
        (args.out / "sync.json").write_text(json.dumps(row, indent=2))
        print(json.dumps(row, indent=1), flush=True)
    parallel.shutdown()


def full_3b_bytes(dtype) -> int:
    import torch

    size = torch.empty((), dtype=dtype).element_size()
    return sum(_numel(shape) for _, shape, _, _ in lm_tensors(LAYERS)) * size


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def run_sync(args) -> dict:
    """The sync part: two ranks through rlflow's launcher (`rlflow train --nproc`'s)."""
    from rlflow.job.local import run_local

    command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--sync-rank"]
    code = run_local(command, 2, args.out, startup_timeout=None, stop_signal="USR1")
    if code != 0:
        return {"exit_code": code, "logs": str(args.out / "logs")}
    return json.loads((args.out / "sync.json").read_text())


# ---------------------------------------------------------------- part reshard


def run_reshard(args) -> dict:
    """The receiving side's work of a sync in one process, one device: the 3B tensors as
    `--train-tp` trainer shards, copied into a generation engine of `--gen-tp` 1
    (rlflow.train.generation_role.reshard.copy_overlap, as WeightSync._receive does per bucket), then both
    sides' fingerprints (every shard's partial checksums against the engine's) and their
    comparison. Transfers excluded: what resharding and the check add to a sync."""
    import torch

    from rlflow.train.generation_role.reshard import (
        Layout,
        copy_overlap,
        partial_checksum,
        sample_positions,
    )

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" or args.bf16 else torch.float32
    name = str(dtype).removeprefix("torch.")
    src_tp, dst_tp = args.train_tp, 1
    torch.manual_seed(0)
    layouts, shards, engine = [], [], []
    for tensor, shape, dim, stride in lm_tensors(args.layers):
        layout = Layout(tensor, shape, name, dim, stride)
        layouts.append(layout)
        tp = 1 if dim is None else src_tp
        shards.append(
            [torch.randn(layout.shard_shape(tp), dtype=dtype, device=device) for _ in range(tp)]
        )
        engine.append(torch.empty(layout.shard_shape(dst_tp), dtype=dtype, device=device))
    nbytes = sum(t.numel() * t.element_size() for t in engine)

    def reshard():
        for layout, pieces, dst in zip(layouts, shards, engine):
            for rank, src in enumerate(pieces):
                copy_overlap(layout, src, rank, len(pieces), dst, 0, dst_tp)

    def fingerprints(version):
        train, gen = [], []
        for layout, pieces, dst in zip(layouts, shards, engine):
            positions = sample_positions(layout, version)
            train.append(
                sum(
                    partial_checksum(layout, src, r, len(pieces), positions)
                    for r, src in enumerate(pieces)
                )  # fmt: skip
            )
            gen.append(partial_checksum(layout, dst, 0, dst_tp, positions))
        return train, gen

    def timed(fn, *a):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    reshard_s, check_s = [], []
    for version in range(args.reps + 1):
        reshard_s.append(timed(reshard)[0])
        seconds, (train, gen) = timed(fingerprints, version)
        check_s.append(seconds)
        if train != gen:
            raise SystemExit(f"reshard benchmark: fingerprints differ at version {version}")
    # a torn element must be seen: flip one sampled element of the last tensor, check again
    positions = sample_positions(layouts[-1], 0)
    engine[-1].view(-1)[int(positions[0])] += 1
    torn_train, torn_gen = fingerprints(0)
    row = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": name,
        "layers": args.layers,
        "tensors": len(layouts),
        "gb": nbytes / 1e9,
        "train_tp": src_tp,
        "gen_tp": dst_tp,
        "reshard_s": reshard_s,
        "reshard_median_s": statistics.median(reshard_s[1:]),
        "reshard_gb_per_s": nbytes / 1e9 / statistics.median(reshard_s[1:]),
        "fingerprint_s": check_s,
        "fingerprint_median_s": statistics.median(check_s[1:]),
        "fingerprint_samples_per_tensor": len(positions),
        "fingerprints_equal": True,
        "torn_element_detected": torn_train != torn_gen,
    }
    print(json.dumps(row, indent=1), flush=True)
    return row


# ---------------------------------------------------------------- part steps


def step_runs(args) -> dict[str, list[str]]:
    """The two modes at the same GPU budget: (nproc, overrides) each."""
    half = max(args.gpus // 2, 1)
    if args.tiny:
        common = [
            f"grpo.max_num_steps={args.steps}",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "grpo.num_minibatches=1",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "warm_start.num_steps=0",
            "generation.max_new_tokens=32",
            "checkpointing.enabled=false",
            "logging.progress_bar=false",
        ]
    else:
        common = [
            f"model.checkpoint={args.checkpoint_3b}",
            "parallelism.tensor_parallel_size=1",
            f"grpo.max_num_steps={args.steps}",
            f"grpo.num_prompts_per_step={args.prompts}",
            "grpo.num_generations_per_prompt=8",
            "generation.max_new_tokens=1024",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "checkpointing.enabled=false",
            "data.max_objects=4",
            "preflight.enabled=false",
        ]
    return {
        f"colocated_dp{args.gpus}": common,
        f"separate_{half}gen_{args.gpus - half}train_one_step_off": [
            *common,
            *SEPARATE,
            f"generation.gpus_per_node={half}",
        ],
    }


def run_steps(args) -> dict:
    from rlflow.train.metrics import read_metrics

    if not args.tiny and not (args.checkpoint_3b / "config.json").exists():
        from rlflow.model.tiny import PRESETS, write_tiny_checkpoint

        write_tiny_checkpoint(
            args.checkpoint_3b, seed=0, sizes=PRESETS["qwen25vl-3b"], device="cuda"
        )
    recipe = RECIPE_TINY if args.tiny else RECIPE_3B
    out = {}
    for name, overrides in step_runs(args).items():
        run_dir = args.out / "runs" / name
        command = [sys.executable, "-m", "rlflow.cli", "train", str(recipe), *overrides]
        command += ["--run-dir", str(run_dir), "--nproc", str(args.gpus)]
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        (args.out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        row = {"command": " ".join(command[2:]), "exit_code": proc.returncode}
        row["wall_s"] = time.perf_counter() - start
        if proc.returncode == 0:
            row.update(summarise([r for r in read_metrics(run_dir) if "time/step" in r]))
        else:
            row["stderr_tail"] = proc.stderr[-2000:]
        out[name] = row
        print(name, json.dumps(row, indent=1), flush=True)
    rows = list(out.values())
    if all("step_s" in r for r in rows):
        out["speedup_step_s"] = rows[0]["step_s"] / rows[1]["step_s"]
    return out


def summarise(steps: list[dict]) -> dict:
    later = steps[1:] or steps  # the first step adds graph capture and compilation

    def med(key):
        values = [r[key] for r in later if key in r]
        return statistics.median(values) if values else None

    keys = ["generation", "wait_rollouts", "logprobs", "training", "weight_sync"]
    rollouts = [r["train/generated_tokens"] / max(r["train/response_length"], 1) for r in later]
    return {
        "steps": len(steps),
        "step_s": med("time/step"),
        **{f"{k}_s": med(f"time/{k}") for k in keys},
        "response_length": med("train/response_length"),
        "staleness": med("async/staleness"),
        "rollouts_per_s": statistics.median(rollouts) / med("time/step"),
        "token_mult_prob_error": med("train/token_mult_prob_error"),
        "peak_gib": max((r.get("memory/peak_gib", 0.0) for r in steps), default=0.0),
    }


# ---------------------------------------------------------------- main


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="sync", help="comma-separated: sync, reshard, steps")
    parser.add_argument("--layers", type=int, default=LAYERS, help="sync: decoder layers")
    parser.add_argument("--reps", type=int, default=5, help="sync: timed syncs")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--bf16", action="store_true", help="sync on CPU: bf16 tensors")
    parser.add_argument("--train-tp", type=int, default=2, help="reshard: trainer TP size")
    parser.add_argument("--gpus", type=int, default=2, help="steps: the placement budget")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16, help="steps (3B): prompts per step")
    parser.add_argument("--tiny", action="store_true", help="steps: the CPU smoke test")
    parser.add_argument("--checkpoint-3b", type=Path, default=Path("/tmp/rlflow-bench-3b"))
    parser.add_argument("--sync-rank", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sync_rank:
        return sync_rank(args)
    parts = args.parts.split(",")
    results = {
        "command": " ".join(sys.argv),
        "host": {"machine": platform.node(), "cpus": os.cpu_count()},
        "workload": {
            "sync": f"Qwen2.5-VL-3B language-model tensors, {args.layers} of {LAYERS} layers",
            "steps": "tiny recipe (CPU smoke test)"
            if args.tiny
            else (f"Qwen2.5-VL-3B random weights, {args.prompts} prompts x 8, max_new_tokens 1024"),
        },
    }
    if "sync" in parts:
        results["sync"] = run_sync(args)
    if "reshard" in parts:
        results["reshard"] = run_reshard(args)
    if "steps" in parts:
        results["steps"] = run_steps(args)
    (args.out / RESULTS).write_text(json.dumps(results, indent=2))
    print(f"results: {args.out / RESULTS}")


if __name__ == "__main__":
    main()
