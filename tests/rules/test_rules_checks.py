"""Recipe validation: every bundled recipe loads; cross-field mistakes fail before anything runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.rules import load_checked

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_every_bundled_recipe_validates(recipe):
    load_checked(recipe)


def messages(overrides: list[str]) -> str:
    with pytest.raises(RlflowError) as caught:
        load_checked(TINY, overrides)
    return "\n".join(d.render() for d in caught.value.diagnostics)


def test_video_config_with_a_missing_key_names_it():
    text = messages(
        ["data.train.kind=video", "data.video.temporal_patch_size=2", "data.video.fps=2.0"]
    )
    assert "`data.video.num_frames` is not set, but `data.video.temporal_patch_size` is" in text
    assert "KeyError" not in text


def test_video_rows_without_video_settings_are_refused():
    text = messages(["data.train.kind=mixed"])
    assert "the data has video rows" in text and "data.video.num_frames" in text


def test_frames_must_fill_whole_temporal_patches():
    text = messages(
        ["data.video.num_frames=3", "data.video.temporal_patch_size=2", "data.video.fps=2.0"]
    )
    assert "not a multiple of `temporal_patch_size`" in text


def test_unknown_reward_and_bad_weights_are_reported_together():
    text = messages(["rewards.exact_mach=0.5", "rewards.format=-1"])
    assert "`rewards.exact_mach` is not a known reward" in text and "exact_match" in text
    assert "`rewards.format` weight -1.0 must be a finite number, not negative" in text


def test_train_on_a_bad_recipe_exits_2_with_the_key_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"defaults: {TINY}\ngrpo:\n  num_generations_per_promt: 4\n")
    result = subprocess.run(
        [sys.executable, "-m", "rlflow.cli", "train", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "did you mean `grpo.num_generations_per_prompt`?" in result.stderr
    assert f"{bad.name}:3:3" in result.stderr
    assert "Traceback" not in result.stderr


def test_sequence_parallel_on_at_tensor_parallel_1_is_refused():
    text = messages(["parallelism.sequence_parallel=on"])
    assert "error[recipe.sequence-parallel]" in text
    assert "`parallelism.tensor_parallel_size` is 1" in text and "sequence_parallel: auto" in text
    for ok in (["parallelism.sequence_parallel=off"], ["parallelism.sequence_parallel=auto"]):
        load_checked(TINY, ok)
    load_checked(TINY, ["parallelism.tensor_parallel_size=2", "parallelism.sequence_parallel=on"])


def test_the_megatron_engine_takes_hybrid_models_with_moe_layers_but_not_fp8():
    for builtin in ("tiny-nemotron-h", "tiny-nemotron-h-moe"):
        hybrid = [f"model.checkpoint=builtin:{builtin}", "data.train.kind=text"]
        load_checked(TINY, [*hybrid, "generation.backend=megatron"])  # no diagnostic
        fp8 = messages([*hybrid, "generation.fp8=true", "model.dtype=bfloat16"])
        assert "error[generation.megatron-engine]" in fp8
        assert "no FP8 decode for a hybrid model" in fp8 and "set generation.fp8: false" in fp8
        load_checked(TINY, [*hybrid, "generation.backend=hf"])  # no diagnostic


def test_the_megatron_engine_takes_nemotron_omni_with_moe_layers_but_not_fp8(tmp_path):
    """Omni's layer pattern lives in its config.json's `llm_config`: the rule reads it there."""
    import json

    omni = ["model.checkpoint=builtin:tiny-nemotron-omni"]
    load_checked(TINY, [*omni, "generation.backend=megatron"])  # no diagnostic
    fp8 = messages([*omni, "generation.fp8=true", "model.dtype=bfloat16"])
    assert "no FP8 decode for a hybrid model" in fp8
    config = {
        "architectures": ["NemotronH_Nano_Omni_Reasoning_V3"],
        "model_type": "NemotronH_Nano_Omni_Reasoning_V3",
        "llm_config": {"hybrid_override_pattern": "ME*M-", "num_attention_heads": 4},
        "vision_config": {},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    checkpoint = f"model.checkpoint={tmp_path}"
    load_checked(TINY, [checkpoint, "generation.backend=megatron"])  # E layers: no diagnostic
    text = messages([checkpoint, "generation.fp8=true", "model.dtype=bfloat16"])
    assert "no FP8 decode for a hybrid model" in text


def test_sequence_parallel_is_refused_for_a_hybrid_model():
    from rlflow.rules.allocation import allocation_diagnostics

    hybrid = ["model.checkpoint=builtin:tiny-nemotron-h", "data.train.kind=text"]
    tp2 = [*hybrid, "generation.backend=hf", "parallelism.tensor_parallel_size=2"]
    refused = allocation_diagnostics(load_checked(TINY, tp2), 1, 2)
    assert [d.code for d in refused] == ["allocation.hybrid-sequence-parallel"]
    assert "set parallelism.sequence_parallel: off" in refused[0].help
    off = load_checked(TINY, [*tp2, "parallelism.sequence_parallel=off"])
    assert allocation_diagnostics(off, 1, 2) == []
    # two trainers at TP 2 beside a generation rank: the refusal comes alone, with no
    # complaint that TP 2 does not divide all 3 ranks (it divides the 2 that train)
    separate = [*hybrid, "parallelism.tensor_parallel_size=2", "generation.placement=separate",
                "generation.gpus_per_node=1", "async_grpo.max_staleness=1"]  # fmt: skip
    refused = allocation_diagnostics(load_checked(TINY, separate), 1, 3)
    assert [d.code for d in refused] == ["allocation.hybrid-sequence-parallel"]
