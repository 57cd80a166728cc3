"""The rules of generation.partial_rollouts (rlflow/rules/partial.py): what is not implemented
with them is refused, naming the key and the fix; the keys do nothing with them off."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.rules import load_checked

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
ON = ["generation.partial_rollouts.enabled=true", "generation.partial_rollouts.budget_steps=2",
      "generation.partial_rollouts.max_staleness_steps=3"]  # fmt: skip


def refused(overrides: list[str]) -> str:
    with pytest.raises(RlflowError) as caught:
        load_checked(TINY, overrides)
    return "\n".join(d.render() for d in caught.value.diagnostics)


def test_a_budget_under_which_rows_finish_is_accepted():
    load_checked(TINY, ON)
    # on generation ranks of their own too, one-step-off (rlflow/train/generation_role/)
    separate = ["generation.placement=separate", "generation.gpus_per_node=1"]
    load_checked(TINY, [*ON, *separate, "async_grpo.max_staleness=1"])


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["generation.backend=vllm"], "megatron or hf, not vllm"),
        (["generation.backend=hf", "generation.partial_rollouts.finished_fraction=0.5"],
         "the megatron backend for `finished_fraction`"),
        (["grpo.dynamic_sampling.enabled=true"], "dynamic sampling off"),
        (["loss.importance_sampling.mode=off"], "an importance correction"),
        (["generation.partial_rollouts.budget_steps=0"], "partial rollouts need a budget"),
        (["generation.partial_rollouts.max_staleness_steps=2"], "cannot finish before it is stale"),
    ],
)  # fmt: skip
def test_what_is_not_implemented_is_refused(overrides, says):
    text = refused([*ON, *overrides])
    assert says in text and "recipe.partial-rollouts" in text
    assert "generation.partial_rollouts.enabled=false" in text or "raise budget_steps" in text


def test_its_keys_do_nothing_with_it_off():
    text = refused(["generation.partial_rollouts.budget_steps=2"])
    assert "`generation.partial_rollouts.enabled` is false" in text
