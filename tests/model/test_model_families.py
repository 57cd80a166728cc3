"""The family registry: every shipped family declares itself, and checkpoints or builtin names no
family knows are refused with a diagnostic that lists what is supported."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlflow.errors import RlflowError
from rlflow.model import family
from tests.tiny import FP32


def test_every_family_declares_what_it_is():
    shipped = family.families()
    assert [type(f).__name__ for f in shipped] == [
        "Qwen25VL",
        "QwenText",
        "Qwen2VL",
        "Qwen3VL",
        "Qwen3VLMoe",
        "Qwen3Moe",
        "NemotronH",
        "NemotronOmni",
    ]
    for f in shipped:
        assert f.model_types and f.architectures and f.builtins
        assert f.rope in ("1d", "mrope", "mrope-interleaved")  # descriptive: nothing tests it
    assert family.by_config({"model_type": "qwen3"}) is family.by_builtin("tiny-qwen3")
    assert family.by_config({"architectures": ["Qwen2VLForConditionalGeneration"]}).builtins == (
        "tiny-qwen2vl",
    )
    assert family.by_config({"model_type": "qwen3_vl_moe"}) is family.by_builtin("tiny-qwen3vl-moe")


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path):
    from rlflow.model.build import resolve_checkpoint

    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    cfg = dataclasses.replace(FP32, checkpoint=str(tmp_path))
    with pytest.raises(RlflowError) as err:
        resolve_checkpoint(cfg, tmp_path / "cache")
    (diagnostic,) = err.value.diagnostics
    assert diagnostic.code == "model.unsupported"
    assert "LlamaForCausalLM" in diagnostic.message
    assert "Qwen2VLForConditionalGeneration" in diagnostic.help


def test_an_unknown_builtin_is_refused_naming_the_builtins(tmp_path):
    from rlflow.model.build import resolve_checkpoint

    cfg = dataclasses.replace(FP32, checkpoint="builtin:tiny-llama")
    with pytest.raises(RlflowError) as err:
        resolve_checkpoint(cfg, tmp_path)
    (diagnostic,) = err.value.diagnostics
    assert diagnostic.code == "model.unknown-builtin"
    assert (
        "builtin:tiny-qwen25vl, builtin:tiny-qwen3, builtin:tiny-qwen2vl, builtin:tiny-qwen3vl, "
        "builtin:tiny-qwen3vl-moe" in diagnostic.help
    )
