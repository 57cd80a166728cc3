"""What the serving engine is asked and what it answers: a request of n choices, their rows.

Plain data, no torch: the HTTP layer (rlflow/serve/app.py) builds `Request`s, the engine
(rlflow/serve/engine.py) fills their `Choice`s and calls `Request.finish` from its own thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlflow.generation.base import SamplingParams
from rlflow.model.media import Prompt


class RequestRefused(Exception):
    """A request the engine gave up on: `kind` says why (the server's HTTP status follows it)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        # "weight_update" | "step_ended" | "cancelled" | "engine_error" | "too_long"
        self.kind = kind


@dataclass
class Choice:
    """One completion of a request: its tokens, their logprobs and why it stopped."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" | "length"


@dataclass
class Request:
    """One chat completion: a prompt, its sampling parameters and one seed per choice.

    `stop_check(token_ids) -> bool`: the server's stop strings (text-level); None without.
    A choice's tokens depend on its seed only (rlflow/generation/megatron/sampling.py): choice i of a
    request with seed s draws what row i of `generate()` with seed s draws."""

    prompt: Prompt
    prompt_ids: list[int]
    params: SamplingParams
    seeds: list[int]
    stop_check: Callable[[list[int]], bool] | None = None
    on_done: Callable[[Request], None] | None = None
    choices: list[Choice] = field(default_factory=list)
    error: RequestRefused | None = None
    weight_version: int = -1  # the weights it was generated with (set when it starts)
    superseded: bool = False  # newer weights were announced before it finished
    cancelled: bool = False
    # when it passed each stage of the request path (time.perf_counter(): monotonic, and on
    # Linux comparable across processes): the HTTP side's stages (rlflow/serve/app.py),
    # "admitted" (the engine took it into a prefill), "first_token" (its first check with a
    # token), "done". Read by `--profile` of benchmarks/serve_throughput.py.
    times: dict[str, float] = field(default_factory=dict)
    _remaining: int = 0
    _done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.choices = [Choice() for _ in self.seeds]
        self._remaining = len(self.seeds)

    @property
    def n(self) -> int:
        return len(self.seeds)

    def choice_done(self) -> None:
        self._remaining -= 1
        if self._remaining == 0:
            self.finish()

    def fail(self, error: RequestRefused) -> None:
        if not self._done.is_set():
            self.error = error
            self.finish()

    def finish(self) -> None:
        if self._done.is_set():
            return
        self.times["done"] = time.perf_counter()
        self._done.set()
        if self.on_done is not None:
            self.on_done(self)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)
