"""The rules of `generation.partial_rollouts` (rlflow/train/partial.py; docs/partial-rollouts.md):
what partial rollouts are implemented with, and a budget under which rows can finish. Listed in
rlflow.rules.checks.RULES; the keys themselves do nothing with `enabled: false`
(rlflow.recipe.inert)."""

from __future__ import annotations

from rlflow.errors import Diagnostic
from rlflow.recipe.inert import sampling_mode
from rlflow.recipe.load import LoadedRecipe

_KEY = ("generation", "partial_rollouts")
_OFF = "generation.partial_rollouts.enabled=false"


def partial_rollouts(loaded: LoadedRecipe) -> list[Diagnostic]:
    """Partial rollouts are refused where rlflow does not implement them (the vllm backend,
    multi-turn environments, dynamic sampling, router replay, no importance correction), and
    need a budget that cuts something and lets a row finish before it is stale."""
    recipe = loaded.recipe
    cfg = recipe.generation.partial_rollouts
    if not cfg.enabled:
        return []
    gen = recipe.generation
    refused = [
        (gen.backend == "vllm", ("generation", "backend"),
         "a backend that continues a row from its token ids (megatron or hf, not vllm)",
         "generation.backend=megatron"),
        (cfg.finished_fraction < 1 and gen.backend != "megatron", (*_KEY, "finished_fraction"),
         f"the megatron backend for `finished_fraction` below 1 (backend is {gen.backend})",
         "generation.partial_rollouts.finished_fraction=1.0, or generation.backend=megatron"),
        (recipe.environment.kind != "single_turn", ("environment", "kind"),
         f"single-turn rollouts (a {recipe.environment.kind} trajectory is not continued "
         "across steps)", "environment.kind=single_turn"),
        (recipe.grpo.dynamic_sampling.enabled, ("grpo", "dynamic_sampling", "enabled"),
         "dynamic sampling off (groups that wait for their rows are not filtered)",
         "grpo.dynamic_sampling.enabled=false"),
        (recipe.loss.router_replay and _moe(recipe), ("loss", "router_replay"),
         "router replay off on a mixture-of-experts model (a continued row's earlier tokens "
         "were routed by older weights)", "loss.router_replay=false"),
        (sampling_mode(recipe) == "off", ("loss", "importance_sampling", "mode"),
         "an importance correction for tokens of older weights (tis or mis; auto picks tis)",
         "loss.importance_sampling.mode=auto"),
        (cfg.budget_steps == 0 and cfg.finished_fraction == 1, (*_KEY, "budget_steps"),
         "a budget: budget_steps above 0 or finished_fraction below 1 (as set, every row "
         "finishes in its step)", "e.g. generation.partial_rollouts.budget_steps=256"),
    ]  # fmt: skip
    problems = [
        loaded.diagnostic(
            path,
            "recipe.partial-rollouts",
            f"partial rollouts need {what}",
            help=f"set {fix}, or {_OFF}",
        )  # fmt: skip
        for failed, path, what, fix in refused
        if failed
    ]
    steps = cfg.budget_steps * (cfg.max_staleness_steps + 1)
    if cfg.budget_steps and steps < gen.max_new_tokens:
        problems.append(
            loaded.diagnostic(
                (*_KEY, "budget_steps"),
                "recipe.partial-rollouts",
                f"a row of generation.max_new_tokens ({gen.max_new_tokens}) tokens cannot finish "
                f"before it is stale: budget_steps ({cfg.budget_steps}) x (max_staleness_steps "
                f"({cfg.max_staleness_steps}) + 1) is {steps}",
                help=f"raise budget_steps to at least "
                f"{-(-gen.max_new_tokens // (cfg.max_staleness_steps + 1))}, or "
                "max_staleness_steps",
            )
        )
    return problems


def _moe(recipe) -> bool:
    """Whether the checkpoint has experts (unknown, e.g. not on this machine: `rlflow train`
    runs the rules again where it is)."""
    from rlflow.model.shape import recipe_shape

    shape = recipe_shape(recipe.model.checkpoint)
    return shape is not None and bool(shape.experts)
