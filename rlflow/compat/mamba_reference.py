"""Mamba-2 kernels in plain PyTorch: what megatron-core's Mamba mixer calls, without CUDA.

megatron-core 0.19.2's `MambaMixer` (megatron/core/ssm/mamba_mixer.py) takes its training and
prefill kernels from the `mamba-ssm` and `causal-conv1d` packages (CUDA builds only; PyPI ships
sources). This module is the reference rlflow runs instead where they are absent (CPU CI, the tiny
recipes; `rlflow.compat.cpu_compat` installs it, patch 8), with their signatures:

* `causal_conv1d_fn`: the depthwise causal conv1d (+ SiLU) over [B, D, L];
* `mamba_chunk_scan_combined`: the Mamba-2 state-space duality (SSD) scan, chunked: within a
  chunk a masked (decay-weighted) attention-like product, between chunks the recurrence over
  chunk states, solved at once as a decay-weighted sum (no Python step per chunk);
* `mamba_split_conv1d_scan_combined`: the training path's fused kernel: split the input
  projection into z, xBC, dt; conv; scan; gate with SiLU(z);
* `RMSNormGated`: RMSNorm over groups of channels, gated by SiLU(z) before the norm;
* `causal_conv1d_update` and `selective_state_update`: one decode step on the conv and SSM states.

On a GPU the scan leaves this reference for Triton kernels where they exist: outside autograd
megatron-core's forward (`_triton_forward`: the logprob passes), under autograd mamba-ssm's
forward and backward (`_mamba_ssm_training`: the update; megatron-core ships no backward).

Packed rows: `seq_idx` [B, L] (the row of each token, non-decreasing) keeps the conv window and
the scan state inside a row: a token never sees a token of another row. `seq_idx_of(cu_seqlens)`
turns row starts into it. Every computation runs in float32 and returns the input's dtype.
`sequential_scan` is the naive per-token recurrence the tests hold the chunked scan to.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def seq_idx_of(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Row starts [R+1] (cu_seqlens) -> seq_idx [1, T] (int32: the row of each token)."""
    cu = cu_seqlens.long()
    total = int(cu[-1]) if total is None else total
    lengths = cu[1:] - cu[:-1]
    rows = torch.arange(lengths.numel(), device=cu.device)
    return rows.repeat_interleave(lengths, output_size=total).to(torch.int32)[None]


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None, **_):
    """x [B, D, L], weight [D, W], bias [D] -> [B, D, L]: out[t] = sum_k w[k] x[t - (W-1) + k],
    taps before the row start (seq_idx) or the sequence start read zero.

    One depthwise `F.conv1d` (cuDNN on a GPU, forward and backward): packed rows are spread
    apart with W-1 zeros in front of each, so no window reaches into the row before."""
    width = weight.shape[-1]
    batch, dim, length = x.shape
    xf, wf = x.float(), weight.float()[:, None, :]
    bf = None if bias is None else bias.float()
    if seq_idx is None:
        out = F.conv1d(F.pad(xf, (width - 1, 0)), wf, bf, groups=dim)
    else:
        seq = seq_idx.reshape(batch, length)
        starts = torch.ones_like(seq, dtype=torch.bool)
        starts[:, 1:] = seq[:, 1:] != seq[:, :-1]  # a row starts here (and at each batch row)
        rows = starts.reshape(-1).long().cumsum(0)  # 1-based row of each token, batch-major
        where = torch.arange(batch * length, device=x.device) + (width - 1) * rows
        spread = xf.new_zeros(dim, batch * length + (width - 1) * int(rows[-1]))
        spread = spread.index_copy(1, where, xf.permute(1, 0, 2).reshape(dim, -1))
        conv = F.conv1d(spread[None], wf, bf, groups=dim)[0]  # window ends at each position
        # index_select, not conv[:, idx]: its backward is one index_add, where advanced
        # indexing's sorts the indices (the update's largest cost on an H100 when it did)
        out = conv.index_select(1, where - (width - 1)).reshape(dim, batch, length)
        out = out.permute(1, 0, 2)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.to(x.dtype)


def _dt(dt, dt_bias, dt_softplus, dt_limit):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    low, high = dt_limit
    if low > 0.0 or high != float("inf"):
        dt = dt.clamp(min=low, max=high)
    return dt


def _heads(t, nheads):
    """[B, L, G, N] -> [B, L, H, N] (each group serves H/G consecutive heads)."""
    return t.float().repeat_interleave(nheads // t.shape[2], dim=2)


def _finish(y, x, D, z):
    """y + D x, then the SiLU(z) gate; [B, L, H, P]."""
    if D is not None:
        d = D.float()
        y = y + x.float() * (d[None, None, :, None] if d.dim() == 1 else d[None, None])
    if z is not None:
        y = y * F.silu(z.float())
    return y


def _segment_decay(log_d: torch.Tensor) -> torch.Tensor:
    """log_d [..., K] -> [..., K, K]: exp(log_d[j+1] + ... + log_d[k]) for j <= k (1 on the
    diagonal), 0 above it. Summed from the masked entries themselves, never as a difference of
    two long cumulative sums (which loses precision as the sequence grows)."""
    k = log_d.shape[-1]
    below = torch.tril(torch.ones(k, k, dtype=torch.bool, device=log_d.device), diagonal=-1)
    terms = log_d[..., :, None].expand(*log_d.shape, k).masked_fill(~below, 0.0)
    sums = torch.cumsum(terms, dim=-2)  # [..., k, j]: sum of log_d[j+1..k]
    lower = torch.tril(torch.ones(k, k, dtype=torch.bool, device=log_d.device))
    return torch.exp(sums) * lower.to(sums.dtype)


def mamba_chunk_scan_combined(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
    return_varlen_states=False, **_,
):  # fmt: skip
    """The SSD scan: x [B, L, H, P], dt [B, L, H], A [H], B/C [B, L, G, N] -> y [B, L, H, P]
    (and the final state [B, H, P, N] if asked; with packed rows, the last row's)."""
    if cu_seqlens is not None and seq_idx is None:
        seq_idx = seq_idx_of(cu_seqlens, x.shape[1]).expand(x.shape[0], -1)
    kernel = _mamba_ssm_training(x)
    if kernel is not None and initial_states is None and not return_varlen_states:
        return kernel(
            x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
            seq_idx=None if seq_idx is None else seq_idx.int().contiguous(),
            dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states,
        )  # fmt: skip
    batch, length, nheads, headdim = x.shape
    q = chunk_size
    pad = -length % q
    dtf = _dt(dt, dt_bias, dt_softplus, dt_limit)
    xf, Bf, Cf = x.float(), _heads(B, nheads), _heads(C, nheads)
    seq = torch.zeros(batch, length, dtype=torch.long, device=x.device)
    if seq_idx is not None:
        seq = seq_idx.long()
    if pad:  # padding tokens: dt = 0 (no decay, no input), the last row's index
        xf, Bf, Cf = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, Bf, Cf))
        dtf = F.pad(dtf, (0, 0, 0, pad))
        seq = torch.cat([seq, seq[:, -1:].expand(-1, pad)], 1)
    n = (length + pad) // q
    # chunked views: [B, c, q, H, *]
    xc, Bc, Cc = (t.view(batch, n, q, nheads, -1) for t in (xf, Bf, Cf))
    dtc = dtf.view(batch, n, q, nheads)
    sc = seq.view(batch, n, q)
    acum = torch.cumsum(dtc * A.float()[None, None, None, :], dim=2)  # [B, c, q, H]
    # intra-chunk: y_i = sum_{j<=i, same row} (C_i . B_j) exp(acum_i - acum_j) dt_j x_j
    seg = acum[:, :, :, None, :] - acum[:, :, None, :, :]  # [B, c, i, j, H]
    causal = torch.tril(torch.ones(q, q, dtype=torch.bool, device=x.device))
    same = (sc[:, :, :, None] == sc[:, :, None, :]) & causal  # [B, c, i, j]
    decay = torch.exp(seg.masked_fill(~same[..., None], float("-inf")))
    scores = torch.einsum("bcihn,bcjhn->bcijh", Cc, Bc) * decay * dtc[:, :, None, :, :]
    y = torch.einsum("bcijh,bcjhp->bcihp", scores, xc)
    # chunk states: what each chunk adds to the state of its last token's row
    last = sc[:, :, -1:]  # [B, c, 1]
    to_end = torch.exp(acum[:, :, -1:, :] - acum) * (sc == last)[..., None]  # [B, c, q, H]
    states = torch.einsum("bcjh,bcjhn,bcjhp->bchpn", to_end * dtc, Bc, xc)
    # between chunks: the state entering chunk c is S_{c-1}, where S_c = states_c + d_c S_{c-1}
    # (d_c: the chunk's decay, 0 where its last token starts a row it does not share with the
    # carried state), S_{-1} the initial state. Solved at once as a weighted sum over earlier
    # chunks (weights exp of segment sums of log d): no per-chunk Python step, so the backward
    # is a few batched products instead of one slice copy per chunk.
    init = torch.zeros(batch, 1, nheads, headdim, Bf.shape[-1], device=x.device)
    if initial_states is not None:
        init = initial_states.float()[:, None]
    carried = torch.cat([init, states], 1)  # [B, c+1, H, P, N]: S_{-1}, states_0, ...
    prev_row = torch.cat([seq[:, :1], last[:, :-1, 0]], 1)  # [B, c]: the row the state carries
    keep = last[:, :, 0] == prev_row  # [B, c]: chunk c's last token continues that row
    log_d = F.pad(acum[:, :, -1, :], (0, 0, 1, 0))  # [B, c+1, H]; entry 0 unused
    breaks = F.pad(torch.cumsum((~keep).long(), 1), (1, 0))  # [B, c+1]
    weights = _segment_decay(log_d.transpose(1, 2))  # [B, H, k, j]
    linked = breaks[:, :, None] == breaks[:, None, :]  # no row start between j and k
    weights = weights * linked[:, None].to(weights.dtype)
    entering = torch.einsum("bhkj,bjhpn->bkhpn", weights, carried)  # [B, c+1, ...]: S_{k-1}
    enter = (sc == prev_row[:, :, None]).float()  # [B, c, q]: tokens that see the carried state
    y = y + torch.einsum(
        "bcihn,bchpn,bcih->bcihp", Cc, entering[:, :-1], torch.exp(acum) * enter[..., None]
    )
    state = entering[:, -1]
    y = y.reshape(batch, n * q, nheads, headdim)[:, :length]
    y = _finish(y, x, D, z).to(x.dtype)
    if return_final_states or return_varlen_states:
        return y, state.to(x.dtype if initial_states is None else initial_states.dtype)
    return y


def sequential_scan(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                    seq_idx=None, initial_states=None):  # fmt: skip
    """The naive recurrence, token by token (tests only): h = exp(dt A) h + dt B x^T; y = C h."""
    batch, length, nheads, headdim = x.shape
    dtf = _dt(dt, dt_bias, dt_softplus, (0.0, float("inf")))
    Bf, Cf = _heads(B, nheads), _heads(C, nheads)
    state = torch.zeros(batch, nheads, headdim, Bf.shape[-1])
    if initial_states is not None:
        state = initial_states.float().clone()
    ys = []
    for t in range(length):
        if seq_idx is not None and t > 0:
            new_row = (seq_idx[:, t] != seq_idx[:, t - 1]).float()[:, None, None, None]
            state = state * (1 - new_row)
        decay = torch.exp(dtf[:, t] * A.float())[:, :, None, None]
        state = decay * state + torch.einsum(
            "bh,bhn,bhp->bhpn", dtf[:, t], Bf[:, t], x[:, t].float()
        )
        ys.append(torch.einsum("bhn,bhpn->bhp", Cf[:, t], state))
    return _finish(torch.stack(ys, 1), x, D, z).to(x.dtype), state


def mamba_split_conv1d_scan_combined(
    zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None,
    seq_idx=None, dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu",
    rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
    ngroups=1, norm_before_gate=True, **_,
):  # fmt: skip
    """zxbcdt [B, L, 2*Din + 2*G*N + H] -> y [B, L, Din]: conv and SiLU on xBC, the scan, y + D x,
    gated by SiLU(z) (the norm, if any, is the caller's: rmsnorm_weight must be None)."""
    if rmsnorm_weight is not None or outproj_weight is not None:
        raise NotImplementedError("the reference fuses neither the norm nor the output projection")
    nheads = A.shape[0]
    dim = conv1d_weight.shape[0]  # Din + 2*G*N
    d_inner = zxbcdt.shape[-1] - dim - nheads
    dstate = (dim - d_inner) // (2 * ngroups)
    headdim = headdim or d_inner // nheads
    if initial_states is None and not return_final_states and activation == "silu":
        if _triton_forward(zxbcdt) is not None:
            sizes = (d_inner, dim, nheads, headdim, ngroups, dstate)
            return _triton_split_conv1d_scan(
                zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, seq_idx,
                dt_limit, sizes,
            )  # fmt: skip
    z, xBC, dt = torch.split(zxbcdt, [d_inner, dim, nheads], dim=-1)
    xBC = causal_conv1d_fn(
        xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation
    ).transpose(1, 2)
    x, B, C = torch.split(xBC, [d_inner, ngroups * dstate, ngroups * dstate], dim=-1)
    batch, length = x.shape[:2]
    out = mamba_chunk_scan_combined(
        x.reshape(batch, length, nheads, headdim),
        dt,
        A,
        B.reshape(batch, length, ngroups, dstate),
        C.reshape(batch, length, ngroups, dstate),
        chunk_size,
        D=D,
        z=z.reshape(batch, length, nheads, headdim),
        dt_bias=dt_bias,
        initial_states=initial_states,
        seq_idx=seq_idx,
        dt_softplus=True,
        dt_limit=dt_limit,
        return_final_states=return_final_states,
    )
    if return_final_states:
        return out[0].reshape(batch, length, d_inner), out[1]
    return out.reshape(batch, length, d_inner)


def rms_norm_gated(x, weight, z=None, eps=1e-5, group_size=None, norm_before_gate=False):
    """RMSNorm over groups of `group_size` channels; z gates (SiLU) before or after the norm."""
    xf = x.float()
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.float())
    size = group_size or xf.shape[-1]
    grouped = xf.unflatten(-1, (-1, size))
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    out = normed.flatten(-2) * weight.float()
    if z is not None and norm_before_gate:
        out = out * F.silu(z.float())
    return out.to(x.dtype)


class RMSNormGated(torch.nn.Module):
    """mamba_ssm.ops.triton.layernorm_gated.RMSNorm's interface: forward(x, z=None)."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, **factory):
        super().__init__()  # factory: torch's device and dtype
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, **factory))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        return rms_norm_gated(x, self.weight, z, self.eps, self.group_size, self.norm_before_gate)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, **_):
    """One decode step: x [B, D], conv_state [B, D, W] (updated in place: shifted left, x last)
    -> [B, D], the conv output at the new token."""
    conv_state.copy_(torch.cat([conv_state[:, :, 1:], x[:, :, None].to(conv_state.dtype)], -1))
    out = (conv_state.float() * weight.float()[None]).sum(-1)
    if bias is not None:
        out = out + bias.float()
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.to(x.dtype)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, **_):  # fmt: skip
    """One decode step on the SSM state [B, H, P, N] (in place): x [B, H, P], dt [B, H],
    A [H], B/C [B, G, N] -> y [B, H, P]."""
    nheads = x.shape[1]
    dtf = _dt(dt, dt_bias, dt_softplus, (0.0, float("inf")))
    Bf = B.float().repeat_interleave(nheads // B.shape[1], dim=1)
    Cf = C.float().repeat_interleave(nheads // C.shape[1], dim=1)
    decay = torch.exp(dtf * A.float())[:, :, None, None]
    new = decay * state.float() + torch.einsum("bh,bhn,bhp->bhpn", dtf, Bf, x.float())
    state.copy_(new.to(state.dtype))
    y = torch.einsum("bhn,bhpn->bhp", Cf, new)
    y = _finish(y[:, None], x[:, None], D, None if z is None else z[:, None])[:, 0]
    return y.to(x.dtype)


TRITON_FORWARD = True  # benchmarks/nemotron_h_moe_gpu_check.py turns it off to compare
# The devices whose tensors megatron-core's Triton kernels take, here and in the generation
# engine (rlflow/generation/megatron/mamba_state.py); the interpreter test
# (tests/generation/test_generation_mamba_triton.py) adds "cpu" under TRITON_INTERPRET=1.
TRITON_DEVICES = ("cuda",)
MAMBA_SSM_TRAINING = True  # likewise


def _mamba_ssm_training(t: torch.Tensor):
    """mamba-ssm's Triton SSD scan, forward and backward, for the update on a GPU: a bf16/fp16
    CUDA tensor under autograd, and `mamba_ssm` importable (from 2.3 it installs without compiling
    CUDA: `pip install --no-build-isolation --no-deps mamba-ssm`); else None."""
    if not (MAMBA_SSM_TRAINING and t.is_cuda and torch.is_grad_enabled()):
        return None
    if t.dtype not in (torch.bfloat16, torch.float16):  # fp32 (the tiny recipes): the reference,
        # exact and quick at their size; mamba-ssm's autotuning took minutes there
        return None
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        return None
    return mamba_chunk_scan_combined


def _triton_forward(t: torch.Tensor):
    """megatron-core's Triton forward kernels (varlen conv, varlen SSD scan) where they can
    replace the reference: a CUDA tensor outside autograd (the trainer's logprob and reference
    passes; megatron-core 0.19.2 ships no backward for them) and Triton importable; else None."""
    if not (TRITON_FORWARD and t.device.type in TRITON_DEVICES) or torch.is_grad_enabled():
        return None
    return triton_varlen_kernels()


@functools.cache
def triton_varlen_kernels():
    """megatron-core's Triton (causal_conv1d_varlen_fn, mamba_chunk_scan_combined_varlen): the
    forward over packed variable-length rows, here and in the engine's prefill
    (rlflow/generation/megatron/mamba_state.py); None where Triton is missing."""
    try:
        from megatron.core.ssm.ops.causal_conv1d_varlen import causal_conv1d_varlen_fn
        from megatron.core.ssm.ops.ssd_combined import mamba_chunk_scan_combined_varlen
    except ImportError:
        return None
    return causal_conv1d_varlen_fn, mamba_chunk_scan_combined_varlen


def _row_starts(seq_idx, batch: int, length: int) -> list[int]:
    """The packed rows' starts over the flattened [batch * length] tokens (host: one sync)."""
    starts = []
    for b in range(batch):
        starts.append(b * length)
        if seq_idx is not None:
            change = (seq_idx[b, 1:] != seq_idx[b, :-1]).nonzero().flatten() + 1
            starts.extend((change + b * length).tolist())
    return starts + [batch * length]


def varlen_chunks(cu: list[int], chunk: int) -> tuple[list[int], list[int], list[int]]:
    """Chunk boundaries aligned to each row's start, each row's last chunk, each chunk's row:
    `mamba_chunk_scan_combined_varlen`'s cu_chunk_seqlens, last_chunk_indices and seq_idx (an
    empty row gets one empty chunk)."""
    bounds, last, rows = [0], [], []
    for row, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        pos = start + chunk
        while pos < end:
            bounds.append(pos)
            rows.append(row)
            pos += chunk
        bounds.append(end)
        rows.append(row)
        last.append(len(bounds) - 2)
    return bounds, last, rows


def _triton_split_conv1d_scan(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                              seq_idx, dt_limit, sizes):  # fmt: skip
    """mamba_split_conv1d_scan_combined's forward on megatron-core's Triton kernels: the packed
    rows (seq_idx, else each batch row) as variable-length sequences, so no state crosses a row
    boundary. Equal to the reference within bf16 (benchmarks/mamba_kernels_gpu_check.md)."""
    conv_fn, scan_fn = _triton_forward(zxbcdt)
    d_inner, dim, nheads, headdim, ngroups, dstate = sizes
    batch, length = zxbcdt.shape[:2]
    total = batch * length
    z, xBC, dt = torch.split(zxbcdt.reshape(total, -1), [d_inner, dim, nheads], dim=-1)
    cu = _row_starts(seq_idx, batch, length)
    device = zxbcdt.device

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    xBC = conv_fn(xBC.contiguous(), conv1d_weight, conv1d_bias, ints(cu), activation="silu")
    x, B, C = torch.split(xBC, [d_inner, ngroups * dstate, ngroups * dstate], dim=-1)
    bounds, last, rows = varlen_chunks(cu, chunk_size)
    out = torch.empty(total, nheads, headdim, dtype=zxbcdt.dtype, device=device)
    scan_fn(
        x.reshape(total, nheads, headdim), dt.contiguous(), A, B.reshape(total, ngroups, dstate),
        C.reshape(total, ngroups, dstate), chunk_size, ints(bounds), ints(last), ints(rows), out,
        D=D, z=z.reshape(total, nheads, headdim), dt_bias=dt_bias, dt_softplus=True,
        dt_limit=dt_limit, state_dtype=torch.float32,
    )  # fmt: skip
    return out.reshape(batch, length, d_inner)
