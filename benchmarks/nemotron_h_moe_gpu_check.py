"""GPU check: Nemotron-H with MoE layers at the 30B-A3B shapes, rlflow against HF, and the
trainer's forward + backward time (issue 33, items 1 and 3).

Model: `nemotron-h-30b-a3b-8l`, the first 8 layers of Nemotron-3-Nano-30B-A3B (`MEMEM*EM`: 4
Mamba-2 mixers of 64 heads x 64, 3 MoE layers of 128 squared-ReLU experts of 1856, top-6,
scaling 2.5, a shared expert of 3712, 1 attention layer of 32/2 heads of 128; hidden 2688,
vocab 131072; 4.8 B parameters), random weights written in bf16 on the GPU, loaded through
megatron-bridge like any checkpoint.

Run on one GPU from the tree's root (PYTHONPATH = the tree, megatron-core/bridge installed):

    python3 benchmarks/nemotron_h_moe_gpu_check.py --out "$OUT"        # ~5 min
    # CPU smoke test (builtin-sized `tiny-nemotron-h-moe`, fp32)
    uv run python benchmarks/nemotron_h_moe_gpu_check.py --tiny --out /tmp/nemotron-h-moe

It records which path each part runs (the Mamba mixer's kernels, the grouped experts' kernel),
then:

* parity: HF `NemotronHForCausalLM` (bf16, its PyTorch Mamba path) and rlflow's packed trainer
  (bf16) on 4 right-padded rows of ragged lengths: token logprobs (max and mean absolute
  difference, the mult-prob error exp(mean |diff|)), and the routing agreement of rlflow's
  routers with HF's top-6 per MoE layer (bf16 hidden states differ, so near-ties may route
  differently: what router replay is for);
* timing: the packed trainer's logprob pass (no grad: the Mamba conv and scan on megatron-core's
  Triton forward kernels; on a GPU also on the reference, `logprob_reference_scan_*`, with the
  two passes' logprob differences) and forward + backward of a weighted
  logprob sum on --rows rows of --length tokens (CUDA-synchronised wall time, median of --reps
  after 2 warm-ups): tokens/s and MFU = (2 or 6) x active matmul parameters x tokens / time /
  the measured bf16 matmul rate. Active matmul parameters per token: Mamba in/out projections,
  attention q/k/v/o, each MoE layer's router, top-6 experts and shared expert, the LM head (the
  Mamba scan's and attention's own FLOPs are not counted).

Results: `<out>/nemotron_h_moe_gpu_check.json`. Exit 0 with the numbers; exit 1 without a GPU
(unless --tiny).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PARITY_LENGTHS = [300, 517, 128, 441]


def active_params(sizes) -> dict:
    """Matmul parameters a token passes through, per layer kind and in all."""
    h = sizes.hidden
    inner = sizes.mamba_heads * sizes.mamba_head_dim
    conv = inner + 2 * sizes.mamba_groups * sizes.state
    mamba = h * (inner + conv + sizes.mamba_heads) + inner * h
    q, kv = sizes.heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim
    attention = h * (q + 2 * kv) + q * h
    expert = 2 * h * sizes.expert_intermediate
    moe = h * sizes.experts + sizes.topk * expert + 2 * h * sizes.shared_expert_intermediate
    mlp = 2 * h * sizes.intermediate
    per = {"M": mamba, "*": attention, "E": moe, "-": mlp}
    layers = sum(per[kind] for kind in sizes.pattern)
    head = h * sizes.vocab_size
    total_experts = sizes.pattern.count("E") * sizes.experts * expert
    return {"per_layer": per, "active": layers + head, "routed_expert_params": total_experts}


def timed(fn, reps: int, device) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batch(lengths, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(10, vocab, (n,), generator=g)
        mask[i, :n] = True
    return ids.to(device), mask.to(device)


def packed_logprobs(policy, ids, mask):
    from rlflow.model.media import Media
    from rlflow.model.packed_forward import pack_rows, target_logprobs

    targets = mask[:, 1:] & mask[:, :-1]
    packed = pack_rows(policy.core, ids, mask, mask, targets, [Media()] * ids.shape[0])
    return target_logprobs(policy.core, packed, (None, None), with_entropy=False)[0]


def hf_routes(hf, ids, mask, moe_layers, topk):
    """HF's logprobs and each MoE layer's chosen experts [rows, L, layers, k] (-1 elsewhere)."""
    rows, length = ids.shape
    routes = torch.full((rows, length, len(hf.model.layers), topk), -1, device=ids.device)
    hooks = []
    for index in moe_layers:

        def record(module, args, output, index=index):
            routes[:, :, index] = output[2].view(rows, length, topk)

        hooks.append(hf.model.layers[index].mixer.gate.register_forward_hook(record))
    try:
        logits = hf(input_ids=ids, attention_mask=mask.long()).logits.float()
    finally:
        for hook in hooks:
            hook.remove()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
    routes[~mask] = -1
    return lp[mask[:, 1:] & mask[:, :-1]], routes


def parity(policy, hf, sizes, device) -> dict:
    from types import SimpleNamespace

    from rlflow.model.moe import routing

    lengths = [n // 8 for n in PARITY_LENGTHS] if sizes.hidden <= 128 else PARITY_LENGTHS
    ids, mask = batch(lengths, sizes.vocab_size or 200, device, seed=1)
    moe_layers = [i for i, kind in enumerate(sizes.pattern) if kind == "E"]
    with torch.no_grad():
        hf_lp, routes = hf_routes(hf, ids, mask, moe_layers, sizes.topk)
        with routing.replayed(
            policy, SimpleNamespace(routing=routes, attention_mask=mask), packed=True, replay=False
        ):
            ours = packed_logprobs(policy, ids, mask).float()
        metrics = routing.step_metrics(policy)
        with routing.replayed(
            policy, SimpleNamespace(routing=routes, attention_mask=mask), packed=True, replay=True
        ):
            replayed = packed_logprobs(policy, ids, mask).float()
        routing.step_metrics(policy)
    diff, rdiff = (ours - hf_lp).abs(), (replayed - hf_lp).abs()
    return {
        "rows": lengths,
        "logprob_max_abs_diff": float(diff.max()),
        "logprob_mean_abs_diff": float(diff.mean()),
        "mult_prob_error": float(torch.exp(diff.mean())),
        "routing_agreement_with_hf": metrics.get("moe/routing_agreement"),
        "expert_agreement_with_hf": metrics.get("moe/expert_agreement"),
        "replayed_hf_routes_mult_prob_error": float(torch.exp(rdiff.mean())),
        "replayed_hf_routes_max_abs_diff": float(rdiff.max()),
    }


def timing(policy, sizes, args, device, matmul_tflop_s: float) -> dict:
    from rlflow.compat import mamba_reference as ref
    from rlflow.train.update import _backward

    ids, mask = batch([args.length] * args.rows, sizes.vocab_size or 200, device, seed=2)
    tokens = int(mask.sum())
    active = active_params(sizes)["active"]
    chunk = policy.chunks[0]

    def logprob_pass():
        with torch.no_grad():
            packed_logprobs(policy, ids, mask)

    def reference_pass():
        ref.TRITON_FORWARD = False
        try:
            logprob_pass()
        finally:
            ref.TRITON_FORWARD = True

    def update():
        chunk.zero_grad_buffer()
        lp = packed_logprobs(policy, ids, mask)
        _backward((lp * torch.linspace(-1.0, 1.0, lp.numel(), device=device)).sum())

    out = {"rows": args.rows, "length": args.length, "tokens": tokens}
    passes = [("logprob", logprob_pass, 2), ("update", update, 6)]
    if device.type == "cuda":  # the logprob pass on the reference scan and conv, to compare
        passes.insert(1, ("logprob_reference_scan", reference_pass, 2))
        with torch.no_grad():
            triton_lp = packed_logprobs(policy, ids, mask).float()
            ref.TRITON_FORWARD = False
            reference_lp = packed_logprobs(policy, ids, mask).float()
            ref.TRITON_FORWARD = True
        diff = (triton_lp - reference_lp).abs()
        out["logprob_triton_vs_reference_max_abs_diff"] = float(diff.max())
        out["logprob_triton_vs_reference_mean_abs_diff"] = float(diff.mean())
    for name, fn, factor in passes:
        seconds = timed(fn, args.reps, device)
        out[f"{name}_s"] = seconds
        out[f"{name}_tokens_per_s"] = tokens / seconds
        out[f"{name}_mfu"] = factor * active * tokens / seconds / (matmul_tflop_s * 1e12)
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if (
        args.profile and device.type == "cuda"
    ):  # where one update's and one logprob pass's time goes
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("update", update), ("logprob", logprob_pass)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
            (args.out / f"profile_{name}.txt").write_text(table)
    return out


def paths(policy) -> dict:
    from megatron.core.ssm import mamba_mixer

    from rlflow.compat import mamba_reference as ref
    from rlflow.model.moe.experts import _grouped_kernel_runs

    layers = policy.core.decoder.layers
    layer = next(layer for layer in layers if hasattr(getattr(layer, "mlp", None), "router"))
    experts = layer.mlp.experts
    fc1, _ = experts.stacked_weights()
    x = torch.zeros(8, fc1.shape[2], dtype=fc1.dtype, device=fc1.device)
    return {
        "mixer_training_kernel": mamba_mixer.mamba_split_conv1d_scan_combined.__module__,
        "update_scan": "mamba-ssm (Triton)" if ref._mamba_ssm_training(x) else "reference",
        "experts": type(experts).__name__,
        "experts_computation": getattr(experts._grouped, "__name__", "SequentialMLP"),
        "grouped_mm_kernel": _grouped_kernel_runs(x, fc1),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/rlflow-nemotron-h-30b-a3b-8l"))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test, fp32")
    parser.add_argument("--profile", action="store_true",
                        help="GPU: profile_update.txt, profile_logprob.txt (ops by GPU time)")  # fmt: skip
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        print("no GPU (use --tiny for the CPU smoke test)", file=sys.stderr)
        return 1
    from grpo_shaped import ceilings
    from transformers import NemotronHForCausalLM

    from rlflow.model.build import load_policy
    from rlflow.model.families.nemotron_h import PRESETS, write_tiny_nemotron_h
    from tests.tiny import FP32, SINGLE, init_single_rank

    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f} s] {message}", flush=True)

    device = torch.device("cpu" if args.tiny else "cuda")
    name = "tiny-nemotron-h-moe" if args.tiny else "nemotron-h-30b-a3b-8l"
    sizes = PRESETS[name]
    if args.tiny:
        args.rows, args.length, args.reps = 2, 64, 1
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"model": name, "device": torch.cuda.get_device_name() if not args.tiny else "cpu"}
    result["params"] = active_params(sizes)
    result["ceilings"] = ceilings(device) if not args.tiny else {"matmul_tflop_s": 1.0}
    log(f"ceilings {result['ceilings']}")
    checkpoint = args.work / name
    if not (checkpoint / "config.json").is_file():
        write_tiny_nemotron_h(checkpoint, seed=0, sizes=sizes, device=device.type)
    log(f"checkpoint {checkpoint}")
    init_single_rank()
    dtype = "float32" if args.tiny else "bfloat16"
    model_cfg = dataclasses.replace(FP32, dtype=dtype)
    policy = load_policy(checkpoint, model_cfg, SINGLE, trainable=True)
    result["paths"] = paths(policy)
    log(f"policy loaded; paths {result['paths']}")
    hf = NemotronHForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype))
    hf = hf.to(device).eval()
    result["parity"] = parity(policy, hf, sizes, device)
    log(f"parity {result['parity']}")
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["timing"] = timing(policy, sizes, args, device, result["ceilings"]["matmul_tflop_s"])
    log(f"timing {result['timing']}")
    (args.out / "nemotron_h_moe_gpu_check.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
