"""The recipe's `environment.kind` -> an Environment (one place, so the interface module never
imports its implementations)."""

from __future__ import annotations

from rlflow.environment.base import Environment


def make_environment(recipe, encoder) -> Environment:
    """The environment `recipe.environment` names, on the rank's prompt encoder."""
    cfg = recipe.environment
    # gym: the step's rollouts are Gym's episodes (rlflow/train/gym/source.py); validation
    # still generates single-turn on the recipe's data.validation (docs/gym.md)
    if cfg.kind in ("single_turn", "gym"):
        from rlflow.environment.single_turn import SingleTurn

        return SingleTurn(encoder)
    if cfg.kind == "tool_scenes":
        from rlflow.environment.tool_scenes import ToolScenes

        return ToolScenes(
            encoder, cfg.max_turns, recipe.data.prompt_suffix, cfg.task_timeout_s,
            cfg.tool_call_format,
        )  # fmt: skip
    raise ValueError(f"unknown environment.kind {cfg.kind!r}")  # the schema's Literal refuses it
