"""rlflow.model.shape: the sizes the dry run checks recipes against, read without torch.

A builtin's sizes (its family's `builtin_config`, nothing written) are the ones its written
checkpoint's config.json holds; a config.json that is not a small regular file is not read.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlflow.model import family
from rlflow.model.shape import recipe_shape


@pytest.mark.parametrize("name", family.builtin_names())
def test_a_builtins_sizes_are_its_written_checkpoints(family_ckpt, name):
    assert recipe_shape(f"builtin:{name}") == recipe_shape(str(family_ckpt(name)))


def test_a_config_that_is_not_a_regular_file_is_not_read(tmp_path):
    os.mkfifo(tmp_path / "config.json")  # open() on it would wait for a writer forever
    assert recipe_shape(str(tmp_path)) is None
    assert recipe_shape(str(tmp_path / "missing")) is None


def test_reading_a_builtins_sizes_imports_no_torch():
    code = (
        "import sys\nfrom rlflow.model.shape import recipe_shape\n"
        "assert recipe_shape('builtin:tiny-qwen3vl-moe').experts == 4\n"
        "print(sorted(m for m in ('torch', 'transformers', 'megatron') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_hybrid_keeps_kv_in_its_attention_layers_only():
    """Nemotron-H `M-*M-`: five layers, one attention layer holds KV; its HF config's unused
    expert keys (`n_routed_experts` with no `moe` layer) make no MoE."""
    from rlflow.model.shape import shape_of_config

    shape = recipe_shape("builtin:tiny-nemotron-h")
    assert (shape.layers, shape.kv_layers, shape.experts) == (5, 1, 0)
    assert shape.kv_bytes_per_token(2) == 2 * 1 * shape.kv_heads * shape.head_dim * 2
    moe = shape_of_config(
        {
            "hybrid_override_pattern": "ME*E",
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "num_attention_heads": 4,
        }
    )
    assert (moe.layers, moe.kv_layers, moe.experts, moe.topk) == (4, 1, 8, 2)
