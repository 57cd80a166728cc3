"""Mamba layers on megatron-core's Triton kernels equal rlflow's reference: the engine's prefill
and decode, and the trainer's passes without autograd.

On CUDA tensors `mamba_state.prefill` scans every prompt in one call of megatron-core's Triton
`mamba_chunk_scan_combined_varlen`, and `mamba_state.decode` calls its Triton
`causal_conv1d_update` and `selective_state_update` in place on the rows' slots
(`conv_state_indices`, `state_batch_indices`); a CPU engine takes the reference of
rlflow/compat/mamba_reference.py (one prompt's scan at a time). CI has no GPU, so here the
kernels' own source runs on CPU tensors through Triton's interpreter (a subprocess with
TRITON_INTERPRET=1: Triton reads it when it is first imported), the way the engine calls them:
prompts of several scan chunks, of one token and in between, prefilled together; a prompt's two
samples continuing from copies of its slot, rows on scattered slots, several steps and layers.
The trainer's logprob and reference passes (no autograd) run `mamba_split_conv1d_scan_combined`
on the same varlen kernels, packed rows as variable-length sequences: checked on rows packed
two and three to a batch row. It holds the conv op's activation convention
(SiLU only for the string "silu"; `True` turns it off, which a GPU check once read as the op
disagreeing). On a GPU, benchmarks/hybrid_engine_gpu_check.py compares the compiled kernels the same way.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import torch


def test_triton_prefill_and_decode_equal_the_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["prefill", "decode", "trainer", "ok"]


def _interpreter_shims() -> None:
    """What the interpreter needs on this machine, nothing the kernels compute.

    - NumPy 2.5 refuses int() of a one-element array; Triton 3.6's interpreter takes a loop
      bound (`range(seq_len)` in the conv kernel) that way. Index through its one element.
    - An autotuned kernel times each of its configs on a GPU driver; the interpreter has none:
      the first config (any config computes the same values).
    - `selective_state_update` reads the device's compute capability for its block sizes and
      enters `torch.cuda.device(x.device)`; a CPU tensor has no CUDA device: an H100's answer
      and no device switch."""
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    patch, run = interpreter._patch_lang_tensor, Autotuner.run

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    interpreter._patch_lang_tensor = patched
    Autotuner.run = first_config
    torch.cuda.get_device_capability = lambda *_: (9, 0)
    torch.cuda.device = lambda *_: contextlib.nullcontext()


def _run(steps: int, layers: int):
    """Prompts of 150, 1 and 9 tokens prefilled together on slots 5, 3 and 8; the first one's
    two samples on slots 2 and 7; `steps` decode steps of 4 rows through `layers` layers:
    (the prefill's output, each step's output, the conv and SSM states)."""
    from rlflow.generation.megatron.mamba_state import SCAN_CHUNK, MambaStates, decode, prefill
    from tests.generation.test_generation_mamba_state import _weights

    w = _weights()
    g = torch.Generator().manual_seed(2)
    states = MambaStates([w] * layers, slots=9, device="cpu", dtype=torch.float32)
    lengths = [SCAN_CHUNK + 22, 1, 9]  # two chunks, one token, one chunk
    prompts = torch.randn(sum(lengths), 32, generator=g)
    prefilled = [prefill(w, prompts, lengths, states, layer, [5, 3, 8]) for layer in range(layers)]
    states.copy(5, [2, 7])
    slots = torch.tensor([7, 3, 2, 8])  # not in order, not contiguous: as after retirements
    outputs = []
    for _ in range(steps):
        hidden = torch.randn(4, 32, generator=g)
        for layer in range(layers):
            hidden = decode(w, hidden, states, layer, slots)
        outputs.append(hidden)
    return prefilled, outputs, states.conv.clone(), states.ssm.clone()


def _trainer_forward() -> torch.Tensor:
    """The mixer's no-grad forward over 2 batch rows, packed with 3 and 2 rows (seq_idx)."""
    from rlflow.compat import mamba_reference as ref
    from tests.generation.test_generation_mamba_state import _weights

    w = _weights()
    g = torch.Generator().manual_seed(3)
    length = 150
    zxbcdt = torch.randn(2, length, w.in_proj.shape[0], generator=g)
    seq_idx = torch.tensor([[0] * 90 + [1] * 3 + [2] * 57, [0] * 20 + [1] * 130], dtype=torch.int32)
    with torch.no_grad():
        return ref.mamba_split_conv1d_scan_combined(
            zxbcdt, w.conv_weight, w.conv_bias, w.dt_bias, -torch.exp(w.A_log), w.D, 64,
            seq_idx=seq_idx, headdim=w.head_dim, ngroups=w.groups,
        )  # fmt: skip


def main() -> None:
    _interpreter_shims()
    from rlflow.compat import mamba_reference as ref
    from rlflow.generation.megatron import mamba_state

    assert mamba_state._triton_ops() is not None, "megatron-core's Triton ops did not import"
    ref.TRITON_DEVICES = ("cpu",)
    triton = (*_run(steps=4, layers=2), _trainer_forward())
    mamba_state.TRITON_PREFILL = mamba_state.TRITON_DECODE = ref.TRITON_FORWARD = False
    reference = (*_run(steps=4, layers=2), _trainer_forward())
    # the reference itself is the training kernel's, per row (test_generation_mamba_state.py);
    # float32 both, summed in other orders (a chunk's cumulative decay): within 1e-4 of the peak
    for name, got, want in [
        *(("prefill", a, b) for a, b in zip(triton[0], reference[0])),
        *(("decode", a, b) for a, b in zip(triton[1], reference[1])),
        ("decode", triton[2], reference[2]),  # conv states
        ("decode", triton[3], reference[3]),  # SSM states
        ("trainer", triton[4], reference[4]),
    ]:
        error = float((got - want).abs().max() / want.abs().max())
        assert error < 1e-4, f"{name}: {error:.2e} of the peak"
    print("prefill", "decode", "trainer")
    print("ok")


if __name__ == "__main__":
    main()
