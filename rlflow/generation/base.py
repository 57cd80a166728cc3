"""The generation interface: prompts with media in, tokens and per-token logprobs out.

The trainer talks only to `GenerationBackend`; the recipe key `generation.backend` picks the
implementation (`make_backend`). Every backend returns the same `Completion` shape, and
logprobs always mean log p(token) under the model's *unmodified* distribution (temperature 1,
no top-k/top-p), which is what the trainer recomputes: `token_mult_prob_error` then measures
only numerical disagreement between the backend and the trainer.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal

from rlflow.model.forward import Media


@dataclass(frozen=True)
class Prompt:
    """One rollout prompt, in the forms the different backends consume."""

    sample_id: str
    text: str  # chat-templated prompt, compact placeholders (one pad token per image/video)
    token_ids: tuple[int, ...]  # tokenized prompt
    media_tokens_expanded: bool  # True: one pad token per visual embedding (processor output)
    media: Media  # processed pixels for the Megatron and HF backends
    images: tuple = ()  # raw PIL images, for backends that process media themselves (vLLM)
    video: tuple | None = None  # raw frames (PIL), same
    video_fps: float | None = None


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float  # 0 means greedy
    top_p: float
    top_k: int  # 0 disables
    seed: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool  # generate exactly max_new_tokens (benchmarks)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # generated tokens, including the stop token when one ended the row
    logprobs: list[float]  # log p(token), temperature-1 distribution, one per token
    finish_reason: Literal["stop", "length"]


class GenerationBackend(abc.ABC):
    """What the trainer needs from a rollout engine."""

    name: str

    @abc.abstractmethod
    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in order."""

    def refresh_weights(self) -> float:
        """Make the next generate() use the policy's current weights; return seconds spent."""
        return 0.0

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing to release
        """Release processes and memory; safe to call twice."""


def check_backend_ready(gen_cfg) -> None:
    """What the recipe's backend needs on this node, checked before any model is loaded."""
    if gen_cfg.backend == "vllm":
        from rlflow.envs.spec import vllm_spec
        from rlflow.generation.vllm import find_env

        find_env(vllm_spec(gen_cfg.vllm), gen_cfg.vllm.env_root)  # raises, naming the setup command


def make_backend(
    gen_cfg, policy, pad_token_id: int, run_dir, max_prompt_tokens: int
) -> GenerationBackend:
    """The backend the recipe names (`generation.backend`); heavy imports only for that one."""
    if gen_cfg.backend == "megatron":
        from rlflow.generation.megatron import MegatronGeneration

        return MegatronGeneration(
            policy,
            pad_token_id,
            gen_cfg.max_batch_size,
            cuda_graphs=gen_cfg.cuda_graphs,
            compile_decode=gen_cfg.compile_decode,
            share_prompts=gen_cfg.share_prompts,
        )
    if gen_cfg.backend == "hf":
        from rlflow.generation.hf import HFGeneration

        return HFGeneration(policy, pad_token_id, gen_cfg.max_batch_size)
    if gen_cfg.backend == "vllm":
        from rlflow.generation.vllm import VLLMGeneration

        return VLLMGeneration(
            policy, gen_cfg, run_dir, max_model_len=max_prompt_tokens + gen_cfg.max_new_tokens
        )
    raise ValueError(f"unknown generation backend {gen_cfg.backend!r}")
