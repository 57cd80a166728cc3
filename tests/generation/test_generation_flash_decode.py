"""The fused decode attention kernel (rlflow/generation/flash_decode.py) equals the exact path.

The kernel's own source runs here on CPU tensors through Triton's interpreter (a subprocess with
TRITON_INTERPRET=1: Triton reads it when it is first imported); the reference is
the engine's CPU path (split and rotate the fused projection, write the cache, length-masked
SDPA: rlflow/generation/decoder.py). On the GPU, benchmarks/engine_gpu_check.py compares the
compiled kernel against the same reference. A CPU engine never imports the kernels.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import torch

from rlflow.generation import flash_decode
from rlflow.generation.decoder import Dims, LayerWeights, _reference_attention
from rlflow.generation.factory import make_backend
from rlflow.recipe import load_checked
from tests.tiny import TINY_CPU_RECIPE, greedy, mixed_prompts

KERNELS = "rlflow.generation.flash_decode_kernels"


def _case(seed: int, qk_norm: bool):
    torch.manual_seed(seed)
    rows, length, kv, group, dim = 5, 200, 2, 3, 16
    dims = Dims(kv * group, kv, dim, 1e-6, dim**-0.5, None)
    keys = torch.randn(rows, length, kv, dim)
    values = torch.randn_like(keys)
    qkv = torch.randn(rows, kv * (group + 2) * dim)
    angles = torch.rand(rows, 1, dim // 2) * 6
    cos = torch.cat((angles, angles), -1).cos()
    sin = torch.cat((angles, angles), -1).sin()
    # one cached key, rows ending inside the first tile, on a tile edge, late in the cache
    lengths = torch.tensor([2, 30, 65, 129, 200])
    norms = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) if qk_norm else (None, None)
    w = LayerWeights(*([None] * 12))
    w = dataclasses.replace(w, q_norm=norms[0], k_norm=norms[1])
    return dims, keys, values, qkv, cos, sin, lengths, w


def test_a_cpu_engine_never_imports_the_kernels(tiny_policy, tiny_processor):
    # The engine as the trainer builds it from the CPU recipe decodes through the exact path;
    # the kernels' module (the one place rlflow imports Triton) stays unimported. (Triton
    # itself is on every Linux machine: torch's wheels depend on it and megatron-core 0.19.2
    # imports it at `import megatron.core`.)
    sys.modules.pop(KERNELS, None)
    gen = load_checked(TINY_CPU_RECIPE, []).recipe.generation
    engine = make_backend(gen, tiny_policy, tiny_processor.tokenizer.pad_token_id, None, 64)
    prompts = mixed_prompts(tiny_processor)
    done = engine.generate(prompts, greedy(3, tiny_processor.tokenizer.eos_token_id))
    assert [len(c.token_ids) for c in done] == [3] * len(prompts)
    assert KERNELS not in sys.modules


def test_fused_decode_attention_equals_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["1-False", "ok", "4-True", "ok", "2-True", "ok"]


def check(splits: int, qk_norm: bool) -> None:
    dims, keys, values, qkv, cos, sin, lengths, w = _case(splits, qk_norm)
    ref_keys, ref_values = keys.clone(), values.clone()
    slots = torch.arange(len(lengths)) * keys.shape[1] + lengths - 1
    exact = _reference_attention(qkv, w, cos, sin, ref_keys, ref_values, slots, lengths, dims)

    out = flash_decode.attention(
        qkv, cos[:, 0], sin[:, 0], keys, values, lengths, group=dims.group, scale=dims.scale,
        splits=splits, q_norm=w.q_norm, k_norm=w.k_norm, eps=dims.eps,
    )  # fmt: skip
    assert out.shape == exact.shape
    torch.testing.assert_close(out, exact, atol=2e-5, rtol=2e-5)
    # the new key and value went into each row's slot lengths - 1, and nothing else changed
    torch.testing.assert_close(keys, ref_keys, atol=1e-6, rtol=1e-6)
    assert torch.equal(values, ref_values)


def test_splits_fill_the_gpu_and_stop_at_the_cap():
    assert flash_decode.num_splits(512, 2, 132) == 1  # 1,024 programs: already two waves
    assert flash_decode.num_splits(64, 2, 132) == 4
    assert flash_decode.num_splits(1, 2, 132) == flash_decode.MAX_SPLITS


def _interpreter_index_fix() -> None:
    """Triton 3.6's interpreter turns a scalar into a loop bound with int() of a one-element
    array, which numpy 2 refuses; read the element instead (interpreter only)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if __name__ == "__main__":  # the interpreted kernel (see the module docstring)
    _interpreter_index_fix()
    for splits, qk_norm in [(1, False), (4, True), (2, True)]:
        print(f"{splits}-{qk_norm}", flush=True)
        check(splits, qk_norm)
        print("ok", flush=True)
