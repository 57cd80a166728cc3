"""The engine's Mamba decode step on megatron-core's Triton ops equals its reference step.

On CUDA tensors `mamba_state.decode` calls megatron-core's Triton `causal_conv1d_update` and
`selective_state_update` in place on the rows' slots (`conv_state_indices`,
`state_batch_indices`); a CPU engine takes the reference steps of rlflow/compat/mamba_reference.py.
CI has no GPU, so here the kernels' own source runs on CPU tensors through Triton's interpreter
(a subprocess with TRITON_INTERPRET=1: Triton reads it when it is first imported), the way the
engine calls them: a prompt prefilled, its two samples continuing from copies of its slot, rows
on scattered slots, several steps and layers. It holds the conv op's activation convention
(SiLU only for the string "silu"; `True` turns it off, which a GPU check once read as the op
disagreeing). On a GPU, benchmarks/hybrid_engine_gpu_check.py compares the compiled kernels the same way.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import torch


def test_triton_decode_step_equals_the_reference_step():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["triton", "ok"]


def _interpreter_shims() -> None:
    """What the interpreter needs on this machine, nothing the kernels compute.

    - NumPy 2.5 refuses int() of a one-element array; Triton 3.6's interpreter takes a loop
      bound (`range(seq_len)` in the conv kernel) that way. Index through its one element.
    - `selective_state_update` reads the device's compute capability for its block sizes and
      enters `torch.cuda.device(x.device)`; a CPU tensor has no CUDA device: an H100's answer
      and no device switch."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    torch.cuda.get_device_capability = lambda *_: (9, 0)
    torch.cuda.device = lambda *_: contextlib.nullcontext()


def _run(steps: int, layers: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A prompt prefilled on slot 5, its two samples on slots 2 and 7, a second row on slot 3;
    `steps` decode steps through `layers` layers: (each step's output, conv, ssm states)."""
    from rlflow.generation.megatron.mamba_state import MambaStates, decode, prefill
    from tests.generation.test_generation_mamba_state import _weights

    w = _weights()
    g = torch.Generator().manual_seed(2)
    states = MambaStates([w] * layers, slots=9, device="cpu", dtype=torch.float32)
    prompts = [torch.randn(6, 32, generator=g), torch.randn(2, 32, generator=g)]
    for layer in range(layers):
        prefill(w, torch.cat(prompts), [6, 2], states, layer, [5, 3])
    states.copy(5, [2, 7])
    slots = torch.tensor([7, 3, 2])  # not in order, not contiguous: as after retirements
    outputs = []
    for _ in range(steps):
        hidden = torch.randn(3, 32, generator=g)
        for layer in range(layers):
            hidden = decode(w, hidden, states, layer, slots)
        outputs.append(hidden)
    return outputs, states.conv.clone(), states.ssm.clone()


def main() -> None:
    _interpreter_shims()
    from rlflow.generation.megatron import mamba_state

    assert mamba_state._triton_ops() is not None, "megatron-core's Triton ops did not import"
    mamba_state.TRITON_DEVICES = ("cpu",)
    triton = _run(steps=4, layers=2)
    print("triton")
    mamba_state.TRITON_DECODE = False
    reference = _run(steps=4, layers=2)
    for got, want in zip(triton[0], reference[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(triton[1], reference[1], rtol=1e-5, atol=1e-5)  # conv states
    torch.testing.assert_close(triton[2], reference[2], rtol=1e-5, atol=1e-5)  # SSM states
    # the reference path itself is the training kernel's, per row
    # (tests/generation/test_generation_mamba_state.py)
    print("ok")


if __name__ == "__main__":
    main()
