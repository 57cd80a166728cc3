"""The recipe's `environment.kind` -> an Environment (one place, so the interface module never
imports its implementations)."""

from __future__ import annotations

from rlflow.environment.base import Environment


def make_environment(recipe, encoder) -> Environment:
    """The environment `recipe.environment` names, on the rank's prompt encoder."""
    cfg = recipe.environment
    if cfg.kind == "single_turn":
        from rlflow.environment.single_turn import SingleTurn

        return SingleTurn(encoder)
    if cfg.kind == "tool_scenes":
        from rlflow.environment.tool_scenes import ToolScenes

        return ToolScenes(encoder, cfg.max_turns, recipe.data.prompt_suffix, cfg.tool_call_format)
    raise ValueError(f"unknown environment.kind {cfg.kind!r}")  # the schema's Literal refuses it
