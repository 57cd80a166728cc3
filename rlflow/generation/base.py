"""The generation interface: prompts with media in, tokens and per-token logprobs out.

The trainer talks only to `GenerationBackend`; the recipe key `generation.backend` picks the
implementation (`rlflow.generation.factory.make_backend`). Every backend returns the same `Completion` shape, and
logprobs always mean log p(token) under the model's *unmodified* distribution (temperature 1,
no top-k/top-p), which is what the trainer recomputes: `token_mult_prob_error` then measures
only numerical disagreement between the backend and the trainer.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlflow.model.media import Prompt

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float  # 0 means greedy
    top_p: float
    top_k: int  # 0 disables
    seed: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool  # generate exactly max_new_tokens (benchmarks)
    # megatron backend: a pass ends once this share of its rows finished; the rest end
    # `budget` (partial rollouts continue them: rlflow/train/partial.py). 1.0: every row.
    stop_fraction: float = 1.0


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # generated tokens, including the stop token when one ended the row
    logprobs: list[float]  # log p(token), temperature-1 distribution, one per token
    # budget: cut by a partial-rollouts budget before its stop token or max_new_tokens
    finish_reason: Literal["stop", "length", "budget"]
    # MoE models, megatron backend: the experts each token went through, [prompt + generated,
    # layers, k] (int8/int16; -1: never through the model, i.e. the last generated token)
    routing: torch.Tensor | None = None
    # Multi-turn trajectories: 1 where the policy generated the token (trained), 0 where the
    # environment wrote it (tool results, observations: context only, never trained; its
    # logprob entry is 0.0). None: every token is the policy's (single-turn).
    loss_mask: list[int] | None = None
    # The weight version that produced each token (multi-turn turns and partial rollouts span
    # updates; None: all of them the rollout's one version).
    token_versions: list[int] | None = None

    @property
    def num_policy_tokens(self) -> int:
        """The tokens the policy generated (all of them, single-turn)."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)


class GenerationBackend(abc.ABC):
    """What the trainer needs from a rollout engine."""

    name: str
    # The weights generate() uses, as the optimizer steps behind them (0: the start of GRPO).
    # Rollouts carry it, so the trainer can check how stale they are (rlflow.train.generation_role.remote).
    weight_version: int = 0

    @abc.abstractmethod
    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in order."""

    def refresh_weights(self, version: int | None = None) -> float:
        """Make the next generate() use the policy's current weights, which are `version`
        (None: one step after the last refresh); return seconds spent."""
        self.weight_version = self.next_version(version)
        return 0.0

    def next_version(self, version: int | None) -> int:
        return self.weight_version + 1 if version is None else version

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing to release
        """Release processes and memory; safe to call twice."""
