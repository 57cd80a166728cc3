"""The `environment` section's rules (rlflow.recipe.environment_schema): what each kind needs of
the rest of the recipe. `environment_fits` is one entry of rlflow.rules.checks.RULES."""

from __future__ import annotations

from rlflow.errors import Diagnostic
from rlflow.recipe.load import LoadedRecipe


def environment_fits(loaded: LoadedRecipe) -> list[Diagnostic]:
    recipe = loaded.recipe
    env = recipe.environment
    if env.kind == "single_turn":
        return []
    out = []
    if env.kind == "tool_scenes" and env.max_turns < 2:
        out.append(
            loaded.diagnostic(
                ("environment", "max_turns"),
                "recipe.environment-turns",
                f"`environment.max_turns` is {env.max_turns}, but tool_scenes needs 2: a tool "
                "call, then the answer after its result",
                help="set environment.max_turns: 2 or more",
            )
        )
    for split in ("train", "validation"):
        if env.kind == "tool_scenes" and getattr(recipe.data, split).kind == "jsonl":
            out.append(
                loaded.diagnostic(
                    ("data", split, "kind"),
                    "recipe.environment-data",
                    f"`data.{split}.kind` is jsonl, but the tool_scenes environment's tool "
                    "counts objects of a synthetic scene, which JSONL rows do not have",
                    help=f"use data.{split}.kind clevr, text, video or mixed, or "
                    "environment.kind: single_turn",
                )
            )
    if env.kind == "tool_scenes" and recipe.generation.backend == "vllm":  # gym: rules/gym.py
        out.append(
            loaded.diagnostic(
                ("generation", "backend"),
                "recipe.environment-backend",
                f"environment.kind {env.kind} continues each trajectory from its token ids, "
                "but the vllm backend sends prompts as text, which vLLM tokenizes again (a "
                "sampled turn need not be its text's tokenization)",
                help="use generation.backend: megatron (or hf), or environment.kind: single_turn",
            )
        )
    if recipe.loss.overlong_penalty.enabled:
        out.append(
            loaded.diagnostic(
                ("loss", "overlong_penalty", "enabled"),
                "recipe.environment-overlong",
                f"`loss.overlong_penalty` measures one generation against "
                f"generation.max_new_tokens; environment.kind {env.kind} makes several turns, "
                "each with that limit, and rlflow has no per-turn penalty",
                help="set loss.overlong_penalty.enabled: false, or environment.kind: single_turn",
            )
        )
    return out
