"""The recipe's `environment.gym` subsection (docs/gym.md), read when `environment.kind: gym`.

NeMo Gym's agents run multi-turn episodes against rlflow's OpenAI server on the
engine, with Gym's resources servers as the tools and the verifier (`environment.gym`). Its own
module, beside rlflow/recipe/schema.py (which imports it)."""

from __future__ import annotations

from dataclasses import field

from rlflow.frozen import frozen
from rlflow.recipe.bounds import bound


@frozen
class GymConfig:
    # Gym config YAMLs (relative to the working directory or to Gym's install), as ng_run's
    # +config_paths; rlflow adds Gym's vllm_model config, pointed at its own server
    config_paths: list[str]
    agent: str  # the agent server instance (a top-level key of the configs) that runs tasks
    # resources server instances to start; [] starts every one the configs define
    resource_servers: list[str]
    # the tasks: a JSONL file of Gym rows (responses_create_params, ...), or the name of one of
    # the agent's `datasets` in its config
    tasks: str = field(metadata=bound(nonempty=True))
    concurrency: int = field(metadata=bound(ge=1, le=65536))  # Gym tasks in flight at once
    # every Gym server must answer HTTP within this after start, or the run ends naming it
    ready_timeout_s: int = field(metadata=bound(ge=1, le=3600))
    head_port: int = field(metadata=bound(ge=1, le=65535))  # Gym's head server (config lookups)
