"""The recipe's `environment` section: how a rollout is made (docs/environments.md).

`single_turn` is one generation per prompt (every token the policy's); `tool_scenes` is the
built-in multi-turn task, where the policy calls a tool on the row's scene and answers after
its result (rlflow/environment/tool_scenes.py); `gym` runs NeMo Gym's agents against the
engine's OpenAI server (`environment.gym`, rlflow/recipe/gym_schema.py). Its own module, beside rlflow/recipe/schema.py
(which imports it), so the section reads in one place, and a kind with a subsection of its own
(e.g. `gym:`) is added here: a new name in `kind`'s Literal and a field for its settings.
"""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from rlflow.frozen import frozen
from rlflow.recipe.bounds import bound
from rlflow.recipe.gym_schema import GymConfig

MAX_TURNS = 64  # model turns per trajectory at most: far past any task's need


@frozen
class EnvironmentConfig:
    # single_turn: one generation per prompt; tool_scenes: call a tool, then answer;
    # gym: NeMo Gym's agents against the engine's OpenAI server (docs/gym.md)
    kind: Literal["single_turn", "tool_scenes", "gym"]
    # model turns per trajectory at most (single_turn reads none: only its default, 1)
    max_turns: int = field(
        metadata=bound(ge=1, le=MAX_TURNS, help="a tool call and the answer take 2 turns")
    )
    # one task at most: gym, the agent's /run (every turn, tool call, the verification);
    # tool_scenes, its tool calls (generation is batched across trajectories)
    task_timeout_s: int = field(metadata=bound(ge=1, le=86400))
    # a failed task (a tool or server that died, hung, answered malformed output): its group
    # is left out of the step (`continue`; counted in env/failed_tasks) or the run ends naming
    # it (`stop`)
    on_task_failure: Literal["continue", "stop"]
    # tool_scenes: how a call is written. hermes: a JSON object in <tool_call> tags, as the Qwen
    # templates and `rlflow serve` read it; compact: the tool's name and the question's words,
    # `<tool_call> count red squares</tool_call>` (few tokens: a tiny model can learn it)
    tool_call_format: Literal["hermes", "compact"]
    gym: GymConfig  # kind: gym only
