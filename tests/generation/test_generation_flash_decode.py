"""The fused decode attention kernel (rlflow/generation/megatron/flash_decode.py) equals the exact path.

The kernel's own source runs here on CPU tensors through Triton's interpreter (a subprocess with
TRITON_INTERPRET=1: Triton reads it when it is first imported); the reference is
the engine's CPU path (split and rotate the fused projection, write the paged cache, gather
each row's blocks, length-masked SDPA: rlflow/generation/megatron/decoder.py), itself checked against
plain SDPA over each row's keys in order. On the GPU, benchmarks/engine_gpu_check.py compares the
compiled kernel against the same reference. A CPU engine never imports the kernels.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from rlflow.generation.factory import make_backend
from rlflow.generation.megatron import flash_decode
from rlflow.generation.megatron.decoder import Dims, LayerWeights, _reference_attention, _split_qkv
from rlflow.generation.megatron.kv_cache import BLOCK
from rlflow.rules import load_checked
from tests.tiny import TINY_CPU_RECIPE, greedy, mixed_prompts

KERNELS = "rlflow.generation.megatron.flash_decode_kernels"


def _case(seed: int, qk_norm: bool):
    torch.manual_seed(seed)
    rows, length, kv, group, dim = 5, 200, 2, 3, 16
    dims = Dims(kv * group, kv, dim, 1e-6, dim**-0.5, None)
    # the paged cache: each row's 4 blocks scattered over a shuffled pool, the table's last
    # column (and block 0) scratch, as rlflow/generation/megatron/kv_cache.py lays them out
    per_row = -(-length // BLOCK)
    blocks = 1 + rows * per_row + 3  # (three blocks nobody owns)
    keys = torch.randn(blocks, BLOCK, kv, dim)
    values = torch.randn_like(keys)
    table = torch.zeros(rows, per_row + 1, dtype=torch.int32)
    table[:, :per_row] = (torch.randperm(blocks - 1)[: rows * per_row] + 1).view(rows, per_row)
    qkv = torch.randn(rows, kv * (group + 2) * dim)
    angles = torch.rand(rows, 1, dim // 2) * 6
    cos = torch.cat((angles, angles), -1).cos()
    sin = torch.cat((angles, angles), -1).sin()
    # one cached key, rows ending inside the first block, on a block edge, late in the cache
    lengths = torch.tensor([2, 30, 65, 129, 200])
    norms = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) if qk_norm else (None, None)
    w = LayerWeights(*([None] * 12))
    w = dataclasses.replace(w, q_norm=norms[0], k_norm=norms[1])
    return dims, keys, values, table, qkv, cos, sin, lengths, w


def test_a_cpu_engine_never_imports_the_kernels(tiny_policy, tiny_processor):
    # The engine as the trainer builds it from the CPU recipe decodes through the exact path;
    # the kernels' module (the one place rlflow imports Triton) stays unimported. (Triton
    # itself is on every Linux machine: torch's wheels depend on it and megatron-core 0.19.2
    # imports it at `import megatron.core`.)
    sys.modules.pop(KERNELS, None)
    gen = load_checked(TINY_CPU_RECIPE, []).recipe.generation
    engine = make_backend(
        gen, tiny_policy, tiny_processor.tokenizer.pad_token_id, None, 64, role="train"
    )
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
    dims, keys, values, table, qkv, cos, sin, lengths, w = _case(splits, qk_norm)
    ref_keys, ref_values = keys.clone(), values.clone()
    exact = _reference_attention(qkv, w, cos, sin, ref_keys, ref_values, table, lengths, dims)
    # the reference itself against plain SDPA over each row's keys laid out in order
    q, k, v = _split_qkv(qkv, w, cos, sin, dims)
    for r, n in enumerate(lengths.tolist()):
        row_k = ref_keys[table[r].long()].flatten(0, 1)[:n]  # [n, kv, D], the new key last
        row_v = ref_values[table[r].long()].flatten(0, 1)[:n]
        torch.testing.assert_close(row_k[-1], k[r])
        plain = F.scaled_dot_product_attention(
            q[r].view(dims.kv_heads, dims.group, -1), row_k.transpose(0, 1),
            row_v.transpose(0, 1), scale=dims.scale,
        ).reshape(-1)  # fmt: skip
        torch.testing.assert_close(exact[r], plain, atol=1e-5, rtol=1e-5)

    out = flash_decode.attention(
        qkv, cos[:, 0], sin[:, 0], keys, values, table, lengths, group=dims.group,
        scale=dims.scale, splits=splits, q_norm=w.q_norm, k_norm=w.k_norm, eps=dims.eps,
    )  # fmt: skip
    assert out.shape == exact.shape
    torch.testing.assert_close(out, exact, atol=2e-5, rtol=2e-5)
    # the new key and value went into each row's token lengths - 1, and nothing else changed
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
