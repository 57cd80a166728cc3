"""GPU check: rlflow's PyTorch Mamba-2 reference against megatron-core's Triton kernels, in bf16.

Run on one GPU from the tree's root (PYTHONPATH = the tree, megatron-core installed):

    python benchmarks/mamba_kernels_gpu_check.py --out "$OUT"

It records which path each Mamba computation takes on this machine (mamba-ssm / causal-conv1d
importable? megatron-core's Triton ops importable? what rlflow installs in the mixer), then, at
the Nemotron-H 30B-A3B mixer shape (64 heads x 64, 8 groups, state 128, chunk 128) on packed rows:

* prefill scan: reference `mamba_chunk_scan_combined` (seq_idx) vs megatron-core's Triton
  `mamba_chunk_scan_combined_varlen` (outputs and final states per row);
* prefill conv: reference `causal_conv1d_fn` (seq_idx) vs Triton `causal_conv1d_varlen_fn`;
  and the update's conv forward+backward (the reference: one cuDNN depthwise conv) vs the
  per-tap loop it replaced, values, gradients and times;
* decode: reference `causal_conv1d_update` / `selective_state_update` vs megatron-core's Triton
  `causal_conv1d_update` / `selective_state_update`;
* the update's scan: mamba-ssm's Triton forward and backward (its Triton-only build, where
  installed) vs the reference, the output and every input's gradient;
* and the time of each (CUDA events, median of 10 after 3 warm-ups), with the reference's
  forward+backward and the kernels'.

Results: `<out>/mamba_kernels_gpu_check.json` and `.md`. Exit 0 even when a comparison fails
(the lead reads the table); exit 1 only without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

from rlflow.compat import mamba_reference as ref

SHAPE = dict(heads=64, headdim=64, groups=8, state=128, chunk=128, conv_dim=64 * 64 + 2 * 8 * 128)
ROWS = [1500, 3000, 700, 2992]  # packed rows: 8192 tokens, boundaries mid-chunk


def timed(fn, repeat=10, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def close(got, want) -> dict:
    got, want = got.float(), want.float()
    scale = want.abs().max().clamp(min=1e-6)
    err = (got - want).abs().max()
    return {
        "max_abs": float(err),
        "max_rel_to_peak": float(err / scale),
        "ok": bool(err / scale < 2e-2),
    }


def paths() -> dict:
    found = {m: importlib.util.find_spec(m) is not None for m in ("mamba_ssm", "causal_conv1d")}
    triton_ops = {}
    for name in ("ssd_combined", "causal_conv1d_varlen", "causal_conv1d_triton", "mamba_ssm"):
        try:
            importlib.import_module(f"megatron.core.ssm.ops.{name}")
            triton_ops[name] = "importable"
        except Exception as exc:  # noqa: BLE001 (recorded, not raised)
            triton_ops[name] = f"{type(exc).__name__}: {exc}"
    from rlflow.compat import cpu_compat

    installed = cpu_compat.install_mamba_reference()
    from megatron.core.ssm import mamba_mixer

    return {
        "packages": found,
        "megatron_triton_ops": triton_ops,
        "rlflow_reference_installed_in_mixer": installed,
        "mixer_training_kernel": mamba_mixer.mamba_split_conv1d_scan_combined.__module__,
        "mixer_prefill_scan": getattr(mamba_mixer.mamba_chunk_scan_combined, "__module__", None),
        "mixer_conv": getattr(mamba_mixer.causal_conv1d_fn, "__module__", None),
        "mixer_decode": "megatron.core.ssm.ops (Triton: causal_conv1d_update, selective_state_update)",
    }


def inputs(dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    total, h, p, ng, n = (
        sum(ROWS),
        SHAPE["heads"],
        SHAPE["headdim"],
        SHAPE["groups"],
        SHAPE["state"],
    )

    def r(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(dtype)

    return dict(
        x=r(total, h, p), dt=r(total, h, scale=0.5), A=-torch.rand(h, device="cuda", generator=g) - 0.5,
        B=r(total, ng, n, scale=0.3), C=r(total, ng, n, scale=0.3), D=torch.randn(h, device="cuda"),
        z=r(total, h, p), dt_bias=torch.randn(h, device="cuda") * 0.5 - 2.0,
    )  # fmt: skip


def chunk_metadata(cu: list[int], chunk: int):
    bounds, last = [0], []
    for start, end in zip(cu[:-1], cu[1:]):
        pos = start + chunk
        while pos < end:
            bounds.append(pos)
            pos += chunk
        bounds.append(end)
        last.append(len(bounds) - 2)
    return bounds, last


def check_scan(t: dict, result: dict) -> None:
    cu = [0]
    for n in ROWS:
        cu.append(cu[-1] + n)
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    seq_idx = ref.seq_idx_of(cu_t)
    kw = dict(D=t["D"], z=t["z"][None], dt_bias=t["dt_bias"], dt_softplus=True)

    def reference():
        return ref.mamba_chunk_scan_combined(
            t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None], SHAPE["chunk"],
            seq_idx=seq_idx, **kw,
        )  # fmt: skip

    want = reference()
    result["scan_reference_fwd_ms"] = timed(reference)
    # per-row final states of the reference (rows run alone)
    from megatron.core.ssm.ops.ssd_combined import mamba_chunk_scan_combined_varlen

    bounds, last = chunk_metadata(cu, SHAPE["chunk"])
    cu_chunks = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    chunk_seq = seq_idx[0, cu_chunks[:-1].long()].contiguous()
    out = torch.zeros_like(t["x"])

    def triton():
        return mamba_chunk_scan_combined_varlen(
            t["x"], t["dt"], t["A"], t["B"], t["C"], SHAPE["chunk"], cu_chunks,
            torch.tensor(last, dtype=torch.int32, device="cuda"), chunk_seq, out, D=t["D"], z=t["z"],
            dt_bias=t["dt_bias"], dt_softplus=True, state_dtype=torch.float32,
        )  # fmt: skip

    states = triton()
    result["scan_triton_fwd_ms"] = timed(triton)
    result["scan_output"] = close(out, want[0])
    row_states = []
    for s, e in zip(cu[:-1], cu[1:]):
        _, st = ref.mamba_chunk_scan_combined(
            t["x"][None, s:e], t["dt"][None, s:e], t["A"], t["B"][None, s:e], t["C"][None, s:e],
            SHAPE["chunk"], D=t["D"], z=t["z"][None, s:e], dt_bias=t["dt_bias"],
            dt_softplus=True, return_final_states=True,
        )  # fmt: skip
        row_states.append(st[0])
    result["scan_final_states"] = close(states, torch.stack(row_states))

    x = t["x"][None].clone().requires_grad_(True)

    def reference_fwd_bwd():
        y = ref.mamba_chunk_scan_combined(
            x, t["dt"][None], t["A"], t["B"][None], t["C"][None], SHAPE["chunk"],
            seq_idx=seq_idx, **kw,
        )  # fmt: skip
        y.float().sum().backward()

    result["scan_reference_fwd_bwd_ms"] = timed(reference_fwd_bwd, repeat=5, warmup=2)
    result["scan_reference_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20


def check_scan_training(t: dict, result: dict) -> None:
    """The update's scan: mamba-ssm's Triton forward and backward (where installed) against the
    reference, the output and every input's gradient."""
    cu = [0]
    for n in ROWS:
        cu.append(cu[-1] + n)
    seq_idx = ref.seq_idx_of(torch.tensor(cu, dtype=torch.int32, device="cuda"))
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")
    grad_out = torch.randn_like(t["x"][None], dtype=torch.float32)

    def run(kernels: bool):
        ref.MAMBA_SSM_TRAINING = kernels
        leaves = {k: t[k].detach().clone().requires_grad_(True) for k in names}
        batched = {k: v[None] if v.dim() > 1 else v for k, v in leaves.items()}
        y = ref.mamba_chunk_scan_combined(
            batched["x"], batched["dt"], batched["A"], batched["B"], batched["C"], SHAPE["chunk"],
            D=batched["D"], z=batched["z"], dt_bias=batched["dt_bias"], dt_softplus=True,
            seq_idx=seq_idx,
        )  # fmt: skip
        (y.float() * grad_out).sum().backward()
        return y.detach(), {k: v.grad for k, v in leaves.items()}

    result["training_scan_kernel"] = "mamba-ssm" if ref._mamba_ssm_training(t["x"]) else None
    try:
        y_ref, g_ref = run(False)
        y_new, g_new = run(True)
        result["training_scan_output"] = close(y_new, y_ref)
        result["training_scan_grads"] = {k: close(g_new[k], g_ref[k]) for k in names}
        result["training_scan_triton_fwd_bwd_ms"] = timed(lambda: run(True), repeat=5, warmup=2)
        result["training_scan_reference_fwd_bwd_ms"] = timed(lambda: run(False), repeat=5, warmup=2)
    finally:
        ref.MAMBA_SSM_TRAINING = True


def _taps_conv(x, weight, bias=None, seq_idx=None, activation=None):
    """The reference conv before the cuDNN one: a masked shifted product per tap, in float32."""
    width, length = weight.shape[-1], x.shape[-1]
    xf, wf = x.float(), weight.float()
    out = torch.zeros_like(xf)
    for k in range(width):
        shift = width - 1 - k
        tap = torch.nn.functional.pad(xf, (shift, 0))[..., :length]
        if shift:
            same = torch.nn.functional.pad(seq_idx[:, shift:] == seq_idx[:, :-shift], (shift, 0))
            tap = tap * same.to(xf.dtype)[:, None, :]
        out = out + tap * wf[:, k, None]
    out = torch.nn.functional.silu(out + bias.float()[:, None])
    return out.to(x.dtype)


def check_conv(result: dict) -> None:
    from megatron.core.ssm.ops.causal_conv1d_varlen import causal_conv1d_varlen_fn

    g = torch.Generator(device="cuda").manual_seed(1)
    dim, total = SHAPE["conv_dim"], sum(ROWS)
    x = torch.randn(total, dim, device="cuda", generator=g).bfloat16()
    w = (torch.randn(dim, 4, device="cuda", generator=g) * 0.5).bfloat16()
    b = torch.randn(dim, device="cuda", generator=g).bfloat16()
    cu = torch.tensor([0, *torch.tensor(ROWS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq_idx = ref.seq_idx_of(cu)

    def reference():
        return ref.causal_conv1d_fn(x.T[None], w, b, seq_idx=seq_idx, activation="silu")[0].T

    def triton():
        return causal_conv1d_varlen_fn(x, w, b, cu, activation="silu")

    result["conv_prefill"] = close(triton(), reference())
    result["conv_reference_ms"], result["conv_triton_ms"] = timed(reference), timed(triton)
    # the update's conv, forward and backward: one cuDNN depthwise conv (the reference now)
    # against the per-tap loop it replaced (`_taps_conv`), values and gradients
    grad_out = torch.randn(dim, total, device="cuda", generator=g)

    def fwd_bwd(conv):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
        y = conv(leaves[0].T[None], leaves[1], leaves[2], seq_idx=seq_idx, activation="silu")[0]
        (y.float() * grad_out).sum().backward()
        return y.detach(), [t.grad for t in leaves]

    (y_new, g_new), (y_old, g_old) = fwd_bwd(ref.causal_conv1d_fn), fwd_bwd(_taps_conv)
    result["conv_vs_taps"] = close(y_new, y_old)
    result["conv_vs_taps_grads"] = {k: close(a, c) for k, a, c in zip("xwb", g_new, g_old)}
    result["conv_fwd_bwd_ms"] = timed(lambda: fwd_bwd(ref.causal_conv1d_fn))
    result["conv_taps_fwd_bwd_ms"] = timed(lambda: fwd_bwd(_taps_conv))
    # decode: one token per row, a width-4 state
    from megatron.core.ssm.ops.causal_conv1d_triton import causal_conv1d_update

    rows = 64
    state = torch.randn(rows, dim, 4, device="cuda", generator=g).bfloat16()
    new = torch.randn(rows, dim, device="cuda", generator=g).bfloat16()
    s1, s2 = state.clone(), state.clone()
    want = ref.causal_conv1d_update(new, s1, w, b, activation="silu")
    # the op turns SiLU on with the string "silu" (`silu_activation == "silu"`); True, as this
    # check passed until 2026-12-06, turns it off: the output "disagreed", the state did not
    got = causal_conv1d_update(new, s2, w, b, "silu", None)
    result["conv_decode"] = close(got, want)
    result["conv_decode_state"] = close(s2, s1)
    # as the engine calls it: in place on slots of a larger state buffer (conv_state_indices)
    slots = torch.randperm(2 * rows, device="cuda", generator=g)[:rows]
    pool = torch.randn(2 * rows, dim, 4, device="cuda", generator=g).bfloat16()
    p1, p2 = pool.clone(), pool.clone()
    gathered = p1[slots]
    want = ref.causal_conv1d_update(new, gathered, w, b, activation="silu")
    p1[slots] = gathered
    got = causal_conv1d_update(new, p2, w, b, "silu", slots)
    result["conv_decode_slots"] = close(got, want)
    result["conv_decode_slots_state"] = close(p2, p1)


def check_decode(result: dict) -> None:
    from megatron.core.ssm.ops.mamba_ssm import selective_state_update

    g = torch.Generator(device="cuda").manual_seed(2)
    rows, h, p, ng, n = 64, SHAPE["heads"], SHAPE["headdim"], SHAPE["groups"], SHAPE["state"]
    state = torch.randn(rows, h, p, n, device="cuda", generator=g)
    x = torch.randn(rows, h, p, device="cuda", generator=g).bfloat16()
    dt = (torch.randn(rows, h, device="cuda", generator=g) * 0.5).bfloat16()
    A = -torch.rand(h, device="cuda", generator=g) - 0.5
    B = (torch.randn(rows, ng, n, device="cuda", generator=g) * 0.3).bfloat16()
    C = (torch.randn(rows, ng, n, device="cuda", generator=g) * 0.3).bfloat16()
    D, bias = torch.randn(h, device="cuda"), torch.randn(h, device="cuda") * 0.5 - 2.0
    s1, s2 = state.clone(), state.clone()
    want = ref.selective_state_update(s1, x, dt, A, B, C, D=D, dt_bias=bias, dt_softplus=True)
    got = selective_state_update(
        s2, x, dt[..., None].expand(-1, -1, p), A[:, None, None].expand(-1, p, n), B, C,
        D=D[:, None].expand(-1, p), dt_bias=bias[:, None].expand(-1, p), dt_softplus=True,
    )  # fmt: skip
    result["ssm_decode"] = close(got, want)
    result["ssm_decode_state"] = close(s2, s1)
    result["ssm_decode_reference_ms"] = timed(
        lambda: ref.selective_state_update(
            state.clone(), x, dt, A, B, C, D=D, dt_bias=bias, dt_softplus=True
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: this check compares GPU kernels", file=sys.stderr)
        return 1
    result = {"device": torch.cuda.get_device_name(), "shape": SHAPE, "rows": ROWS}
    try:
        result["paths"] = paths()
    except Exception:  # noqa: BLE001 (e.g. megatron-core or einops missing: recorded)
        result.setdefault("errors", []).append(traceback.format_exc(limit=4))
    for check in (lambda: check_scan(inputs(), result), lambda: check_scan_training(inputs(), result),
                  lambda: check_conv(result), lambda: check_decode(result)):  # fmt: skip
        try:
            check()
        except Exception:  # noqa: BLE001 (each check reports on its own)
            result.setdefault("errors", []).append(traceback.format_exc(limit=4))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mamba_kernels_gpu_check.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Mamba kernels on {result['device']}", "", "| check | result |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in result.items() if k not in ("errors",)]
    lines += ["", *[f"```\n{e}\n```" for e in result.get("errors", [])]]
    (args.out / "mamba_kernels_gpu_check.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
