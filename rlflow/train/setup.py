"""Build everything a GRPO run needs, from a validated recipe: the `Trainer` state."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlflow import parallel
from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe.load import LoadedRecipe
from rlflow.recipe.schema import Recipe
from rlflow.train import watchdog


@dataclass
class Trainer:
    recipe: Recipe
    run_dir: Path
    info: parallel.ParallelInfo
    policy: object  # rlflow.model.build.Policy
    reference: object | None
    encoder: object  # rlflow.model.processor.PromptEncoder
    train_data: object
    val_data: object
    sampler: object  # rlflow.data.PromptSampler
    backend: object  # rlflow.generation.base.GenerationBackend
    checkpointer: object
    log: object  # rlflow.train.metrics.MetricsLog
    stop: object  # rlflow.train.signals.StopRequest
    optimizer: object | None = None
    step: int = 0
    extra: dict = field(default_factory=dict)


def check_layout(recipe: Recipe, info: parallel.ParallelInfo) -> None:
    """Rules that need the world size: fail before any model is built."""
    problems = []
    if recipe.parallelism.pipeline_parallel_size > 1:
        problems.append(
            Diagnostic(
                "train.pipeline-parallel",
                "rlflow's trainer runs with pipeline_parallel_size=1 for now",
                help="use tensor_parallel_size (and data parallelism) to spread the model",
            )
        )
    if recipe.grpo.num_prompts_per_step % info.dp_size:
        problems.append(
            Diagnostic(
                "train.data-parallel",
                f"grpo.num_prompts_per_step ({recipe.grpo.num_prompts_per_step}) is not a multiple of "
                f"the data-parallel size ({info.dp_size})",
                help="each data-parallel rank takes an equal share of the prompts: make "
                "num_prompts_per_step a multiple of world size / (tensor x pipeline x context)",
            )
        )
    if problems:
        raise RlflowError(problems)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def share_vision_cache(policy, reference, enabled: bool) -> None:
    """One per-step vision-feature cache for generation, both logprob passes and the update.

    Only with a frozen tower: its features are then the same in the policy and the reference
    (both load the same weights). `grpo_step` clears it at the start of every step.
    """
    from rlflow.model.vision_cache import VisionCache

    cache = VisionCache(enabled=enabled and policy.is_multimodal)
    for p in (policy, reference):
        if p is not None:
            p.extra["vision_cache"] = cache


def setup(loaded: LoadedRecipe, run_dir: Path) -> Trainer:
    from rlflow.data import PromptSampler, build_dataset
    from rlflow.generation.base import check_backend_ready, make_backend
    from rlflow.launch.preflight import run_preflight
    from rlflow.model.build import load_policy, resolve_checkpoint
    from rlflow.model.processor import PromptEncoder
    from rlflow.train.checkpoint import Checkpointer
    from rlflow.train.metrics import MetricsLog
    from rlflow.train.signals import StopRequest

    recipe = loaded.recipe
    watchdog.beat("startup")  # the process group's rendezvous still counts as start-up
    info = parallel.init_parallel(
        recipe.parallelism, recipe.run.seed, timeout_s=recipe.watchdog.collective_timeout_s
    )
    check_layout(recipe, info)
    if recipe.preflight.enabled:
        watchdog.beat("preflight")
        run_preflight(recipe.preflight, run_dir, recipe.model.checkpoint, info)
    watchdog.beat("model_load")
    check_backend_ready(recipe.generation)
    stop = StopRequest(enabled=recipe.checkpointing.save_on_signal)
    seed_everything(recipe.run.seed)
    checkpoint = resolve_checkpoint(recipe.model, cache_dir=run_dir / "model")
    policy = load_policy(checkpoint, recipe.model, recipe.parallelism, trainable=True)
    reference = None
    if recipe.loss.kl_penalty > 0:
        reference = load_policy(checkpoint, recipe.model, recipe.parallelism, trainable=False)
    share_vision_cache(policy, reference, enabled=recipe.model.freeze_vision)
    encoder = PromptEncoder(checkpoint, recipe.data)
    train_data = build_dataset(recipe.data.train, recipe.data)
    val_data = build_dataset(recipe.data.validation, recipe.data)
    sampler = PromptSampler(len(train_data), recipe.grpo.num_prompts_per_step, recipe.run.seed)
    backend = make_backend(
        recipe.generation, policy, encoder.pad_token_id, run_dir, recipe.data.max_prompt_tokens
    )
    log = MetricsLog(
        run_dir,
        enabled=info.is_main,
        tensorboard=recipe.logging.tensorboard,
        progress_bar=recipe.logging.progress_bar,
        total_steps=recipe.grpo.max_num_steps,
    )
    watchdog.beat("setup")
    return Trainer(
        recipe=recipe,
        run_dir=run_dir,
        info=info,
        policy=policy,
        reference=reference,
        encoder=encoder,
        train_data=train_data,
        val_data=val_data,
        sampler=sampler,
        backend=backend,
        checkpointer=Checkpointer(run_dir, recipe.checkpointing.keep_last),
        log=log,
        stop=stop,
    )
