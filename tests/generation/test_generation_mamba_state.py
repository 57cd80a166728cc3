"""rlflow/generation/megatron/mamba_state.py: a Mamba-2 layer's per-row conv and SSM state.
Packed prefill then single-token decode steps equal the mixer's full-sequence forward (the
training kernel), rows never share state, a prompt's samples continue from copies of its slot,
and slots are given and returned. Random weights in megatron-core's MambaMixer layout, CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlflow.compat import mamba_reference as ref
from rlflow.generation.megatron.mamba_state import MambaStates, MambaWeights, decode, prefill


def _weights(hidden=32, heads=4, head_dim=8, groups=2, state=8) -> MambaWeights:
    g = torch.Generator().manual_seed(0)
    d_inner, conv_dim = heads * head_dim, heads * head_dim + 2 * groups * state

    def r(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    return MambaWeights(
        in_proj=r(2 * d_inner + 2 * groups * state + heads, hidden), conv_weight=r(conv_dim, 4),
        conv_bias=r(conv_dim), dt_bias=r(heads), A_log=torch.rand(heads, generator=g),
        D=r(heads), norm_weight=1 + r(d_inner), out_proj=r(hidden, d_inner), heads=heads,
        head_dim=head_dim, groups=groups, state=state,
    )  # fmt: skip


def _full(w: MambaWeights, hidden: torch.Tensor) -> torch.Tensor:
    """What megatron-core's mixer computes over a whole row (its training path)."""
    y = ref.mamba_split_conv1d_scan_combined(
        F.linear(hidden, w.in_proj)[None], w.conv_weight, w.conv_bias, w.dt_bias,
        -torch.exp(w.A_log), w.D, 16, headdim=w.head_dim, ngroups=w.groups,
    )[0]  # fmt: skip
    return F.linear(
        ref.rms_norm_gated(y, w.norm_weight, None, 1e-5, w.d_inner // w.groups), w.out_proj
    )


def test_prefill_then_decode_equals_the_full_forward_per_row_and_per_sample():
    w = _weights()
    torch.manual_seed(1)
    rows = [torch.randn(n, 32) for n in (9, 2, 5)]  # a row shorter than the conv window too
    states = MambaStates([w], slots=6, device="cpu", dtype=torch.float32)
    slots = [states.allocate() for _ in rows]
    prompt = [r[:-3] if len(r) > 3 else r[:1] for r in rows]
    out = prefill(w, torch.cat(prompt), [len(p) for p in prompt], states, 0, slots)
    torch.testing.assert_close(out, torch.cat([_full(w, p) for p in prompt]), rtol=1e-4, atol=1e-5)
    # two samples of row 0 continue from copies of its slot, with different tokens
    samples = [states.allocate(), states.allocate()]
    states.copy(slots[0], samples)
    tails = [torch.randn(3, 32), torch.randn(3, 32)]
    for step in range(3):
        got = decode(w, torch.stack([t[step] for t in tails]), states, 0, torch.tensor(samples))
        for i, tail in enumerate(tails):
            want = _full(w, torch.cat([prompt[0], tail[: step + 1]]))[-1]
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)
    # the rows themselves go on from their own slots
    rest = [r[len(p) :] for r, p in zip(rows, prompt)]
    for step in range(min(len(t) for t in rest)):
        got = decode(w, torch.stack([t[step] for t in rest]), states, 0, torch.tensor(slots))
        for i, (p, t) in enumerate(zip(prompt, rest)):
            want = _full(w, torch.cat([p, t[: step + 1]]))[-1]
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)


def test_slots_are_given_zeroed_and_returned():
    states = MambaStates([_weights()], slots=2, device="cpu", dtype=torch.float32)
    a, b = states.allocate(), states.allocate()
    assert {a, b} == {0, 1} and states.free_slots == 0
    with pytest.raises(RuntimeError, match="every Mamba state slot is held"):
        states.allocate()
    states.ssm[0, a] = 1.0
    states.release(a)
    with pytest.raises(ValueError, match="already free"):
        states.release(a)
    assert states.allocate() == a and float(states.ssm[0, a].abs().sum()) == 0.0
