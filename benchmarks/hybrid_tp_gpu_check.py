"""The engine's hybrid decoder under tensor parallelism on 2 GPUs (NCCL, CUDA graphs): the CPU
test (tests/generation/test_generation_hybrid_tensor_parallel.py, gloo, eager) cannot capture
the decode step's all-reduces and the KV-sharing all-gather (decoder._gather_kv) in a CUDA
graph; this runs the same cycle where they are captured.

For the tiny Nemotron-H (`M-*M-`, 2 KV heads: TP 2 splits them) and the same with 1 KV head
(TP 2 shares it): greedy rows (CUDA graphs on, fp32) and the trainer's packed logprobs on one
GPU, then on 2 ranks at TP 2; tokens must be equal, logprobs within 1e-4. On a machine without
GPUs, or with `--tiny`, it runs on the CPU over gloo (the CPU test's check, as a smoke run).

    python benchmarks/hybrid_tp_gpu_check.py --out $OUT          # 2 GPUs
    python benchmarks/hybrid_tp_gpu_check.py --out $OUT --tiny   # CPU smoke (gloo, eager)

Writes $OUT/hybrid_tp_gpu_check.json: per case, tokens equal, the largest logprob differences.
Not run on a GPU yet (no GPU in the session that wrote it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch.multiprocessing as mp

    from rlflow.compat import library_logs
    from rlflow.model.families.nemotron_h import PRESETS, write_tiny_nemotron_h
    from rlflow.parallel import _free_port
    from tests.generation.test_generation_hybrid_tensor_parallel import _rank, cycle
    from tests.tiny import SINGLE, init_single_rank

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU only (gloo), even with GPUs")
    args = parser.parse_args()
    if args.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # (before CUDA's lazy init; children inherit it)
    args.out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        sys.exit("needs 2 GPUs (or none: gloo on the CPU)")
    library_logs.quiet()
    init_single_rank()
    work = Path(tempfile.mkdtemp())
    base = PRESETS["tiny-nemotron-h"]
    results = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for case, kv in (("kv2", 2), ("kv1", 1)):
        checkpoint = write_tiny_nemotron_h(
            work / case, seed=0, lm_head_scale=8.0, sizes=dataclasses.replace(base, kv_heads=kv)
        )
        reference = cycle(checkpoint, SINGLE)
        out = work / f"{case}.pt"
        mp.start_processes(
            _rank, args=(str(checkpoint), str(out), _free_port()), nprocs=2, start_method="spawn"
        )
        got = torch.load(out)
        gen = max(
            max(abs(a - b) for a, b in zip(x, y))
            for x, y in zip(got["logprobs"], reference["logprobs"])
        )
        results[case] = {
            "tokens_equal": got["tokens"] == reference["tokens"],
            "max_generation_logprob_diff": gen,
            "max_trainer_logprob_diff": float((got["trainer"] - reference["trainer"]).abs().max()),
        }
        print(case, results[case], flush=True)
    (args.out / "hybrid_tp_gpu_check.json").write_text(json.dumps(results, indent=1))
    ok = all(
        r["tokens_equal"] and r["max_generation_logprob_diff"] < 1e-4
        for k, r in results.items()
        if k != "device"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
