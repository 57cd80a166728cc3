"""The backend the recipe names (`generation.backend`): built here, so base.py imports no backend.

Heavy imports happen only for the chosen backend (vLLM's environment is checked, never imported).
"""

from __future__ import annotations

from rlflow.generation.base import GenerationBackend
from rlflow.recipe.placement import Role


def check_backend_ready(gen_cfg) -> None:
    """What the recipe's backend needs on this node, checked before any model is loaded."""
    if gen_cfg.backend == "megatron" and gen_cfg.fp8:  # on this rank's device, after init
        from rlflow import parallel
        from rlflow.generation.megatron.fp8 import require

        require(parallel.info().device)
    if gen_cfg.backend == "vllm":
        from rlflow.envs.spec import vllm_spec
        from rlflow.generation.vllm.client import find_env

        find_env(vllm_spec(gen_cfg.vllm), gen_cfg.vllm.env_root)  # raises, naming the setup command


def make_backend(
    gen_cfg, policy, pad_token_id: int, run_dir, max_prompt_tokens: int, *, role: Role
) -> GenerationBackend:
    """The backend the recipe names (`generation.backend`); heavy imports only for that one.

    Every engine is built here. `role` is whose engine it is: a trainer's ("train": rollouts
    when colocated, validation when separate) frees its KV cache after each call when
    `generation.release_cache` says so; a generation rank's ("generate") holds nothing else
    and keeps it.
    """
    if gen_cfg.backend == "megatron":
        from rlflow.generation.megatron.engine import MegatronGeneration

        return MegatronGeneration(
            policy,
            pad_token_id,
            max_batch_size=gen_cfg.max_batch_size,
            cuda_graphs=gen_cfg.cuda_graphs,
            compile_decode=gen_cfg.compile_decode,
            share_prompts=gen_cfg.share_prompts,
            fp8=gen_cfg.fp8,
            release_cache=gen_cfg.release_cache and role == "train",
            cache_tokens=gen_cfg.kv_cache_tokens,
        )
    if gen_cfg.backend == "hf":
        from rlflow.generation.hf import HFGeneration

        return HFGeneration(policy, pad_token_id, gen_cfg.max_batch_size)
    if gen_cfg.backend == "vllm":
        from rlflow.generation.vllm.client import VLLMGeneration

        return VLLMGeneration(
            policy, gen_cfg, run_dir, max_model_len=max_prompt_tokens + gen_cfg.max_new_tokens
        )
    raise ValueError(f"unknown generation backend {gen_cfg.backend!r}")
