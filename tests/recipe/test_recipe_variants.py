"""Recipe rules for the issue-12 keys: rewards by import path, scoring, GSPO, overlong shaping,
importance sampling, dynamic sampling and the prompt template; and `auto` importance sampling
resolving per backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.rules import load_checked
from rlflow.train.collect import effective_loss

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"


def messages(overrides: list[str]) -> str:
    with pytest.raises(RlflowError) as caught:
        load_checked(TINY, overrides)
    return "\n".join(d.render() for d in caught.value.diagnostics)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["loss.ratio_level=sequence"], "needs `loss.token_level_loss: false`"),
        (["generation.fp8=true", "generation.backend=hf"],
         "`generation.fp8: true` needs the megatron backend, not `hf`"),
        (["generation.kv_cache_tokens=4096", "generation.backend=hf"],
         "sizes the megatron backend's KV cache; backend `hf` does not read it"),
        (["loss.overlong_penalty.enabled=true", "loss.overlong_penalty.buffer_tokens=9"],
         "must be between 1 and generation.max_new_tokens (8)"),
        (["loss.overlong_penalty.penalty=-1"], "must not be negative"),
        (["loss.importance_sampling.cap=0"], "`loss.importance_sampling.cap` must be positive"),
        (["loss.importance_sampling.mask_below=3"], "must be between 0 and cap (2.0)"),
        (["loss.importance_sampling.mode=icepop"], "importance_sampling.mode"),
        (["grpo.dynamic_sampling.max_extra_rounds=-1"], "must not be negative"),
        (["scoring.accuracy=acc"], "`scoring.accuracy` names `acc`, which is not a known reward"),
        (["scoring.timeout_s=0"], "`scoring.timeout_s` must be in (0, 86400] (it is 0)"),
        (["scoring.num_workers=-1"], "`scoring.num_workers` must be in [0, 1024] (it is -1)"),
        (["data.prompt_template='{question!r}'"], "is not a plain {column} placeholder"),
        (["data.prompt_template='{question'"], "`data.prompt_template` is not a valid template"),
        (["rewards.nowhere_mod:fn=1.0"], "no module `nowhere_mod` is importable"),
    ],
)  # fmt: skip
def test_bad_values_are_named(overrides, expected):
    assert expected in messages(overrides)


def test_the_new_keys_load_together():
    loaded = load_checked(
        TINY,
        [
            "loss.ratio_level=sequence",
            "loss.token_level_loss=false",
            "loss.overlong_penalty.enabled=true",
            "loss.overlong_penalty.buffer_tokens=4",
            "grpo.dynamic_sampling.enabled=true",
            "scoring.accuracy=format",
            "data.prompt_template='{question} (hint: {hint})'",
        ],
    )
    assert loaded.recipe.loss.ratio_level == "sequence"
    assert loaded.recipe.data.prompt_template == "{question} (hint: {hint})"


@pytest.mark.parametrize(
    "backend, mode, resolved",
    [
        ("megatron", "auto", "off"),
        ("megatron-fp8", "auto", "tis"),  # FP8 rollouts: a generator that disagrees
        ("vllm", "auto", "tis"),
        ("hf", "auto", "tis"),
        ("megatron", "tis", "tis"),
        ("vllm", "off", "off"),
        ("vllm", "mis", "mis"),
    ],
)
def test_auto_importance_sampling_is_on_for_other_engines_only(backend, mode, resolved):
    backend, _, fp8 = backend.partition("-")
    overrides = [f"generation.backend={backend}", f"loss.importance_sampling.mode={mode}"]
    if fp8:  # FP8 rollouts run in bf16
        overrides += ["generation.fp8=true", "model.dtype=bfloat16"]
    recipe = load_checked(TINY, overrides).recipe
    assert effective_loss(recipe).importance_sampling.mode == resolved
