"""The recipe's `generation.server` section: the OpenAI-compatible server on the engine
(`rlflow serve`; docs/serve.md). Its own module, beside rlflow/recipe/schema.py (which imports
it), so the section reads in one place."""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from rlflow.frozen import frozen
from rlflow.recipe.bounds import bound


@frozen
class ServerConfig:
    # `rlflow train`: every generation rank serves its engine once its first weights are in
    enabled: bool
    # how long a client (rlflow.serve.registry.wait_ready) waits for the job's servers
    ready_timeout_s: int = field(metadata=bound(ge=1, le=86400))
    host: str  # the address the server listens on (0.0.0.0: every interface)
    port: int = field(metadata=bound(ge=0, le=65535, help="0 picks a free port"))
    # rows the engine runs at once (requests of n choices take n)
    max_rows: int = field(metadata=bound(ge=1))
    # prompt + completion tokens of one row at most (longer prompts are refused with a 400)
    context_tokens: int = field(metadata=bound(ge=64))
    # prompt tokens one admission prefills at most (bounds the pause of the running rows)
    max_prefill_tokens: int = field(metadata=bound(ge=1))
    # open connections at most; past it, new ones get HTTP 503 (idle clients cannot starve it)
    max_connections: int = field(metadata=bound(ge=1))
    # a connection that sends nothing for this long is closed (idle clients hold no slot)
    idle_timeout_s: int = field(metadata=bound(ge=1, le=86400))
    # requests in flight when the weights change: finish on the old weights (marked) or a 503
    on_weight_update: Literal["finish_old", "refuse"]
