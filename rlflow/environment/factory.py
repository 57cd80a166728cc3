"""The recipe's `environment.kind` -> an Environment (one place, so the interface module never
imports its implementations).

`environment_override(build)` is for programs that drive the trainer in-process with an
environment that is no recipe kind (benchmarks/multiturn_step_gpu.py: tool turns forced on a
random-weight model): while it is open, every environment the trainer makes is `build`'s.
`rlflow train` never opens one; a recipe's kinds stay the schema's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rlflow.environment.base import Environment

_override: list[Callable] = []  # the open overrides, innermost last


@contextmanager
def environment_override(build: Callable[..., Environment]) -> Iterator[None]:
    """While open, `make_environment(recipe, encoder)` returns `build(recipe, encoder)`
    whatever `recipe.environment.kind` says (rollouts, validation and the warm start alike)."""
    _override.append(build)
    try:
        yield
    finally:
        _override.remove(build)


def make_environment(recipe, encoder) -> Environment:
    """The environment `recipe.environment` names, on the rank's prompt encoder."""
    if _override:
        return _override[-1](recipe, encoder)
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
