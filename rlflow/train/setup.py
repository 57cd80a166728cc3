"""Build everything a GRPO run needs, from a validated recipe: the `Trainer` state."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlflow import parallel
from rlflow.recipe.load import LoadedRecipe
from rlflow.recipe.placement import Role
from rlflow.recipe.schema import ParallelismConfig, Recipe
from rlflow.rules.allocation import check_allocation
from rlflow.train import watchdog

if TYPE_CHECKING:  # types only: setup imports these modules when it builds the trainer
    from rlflow.data.dataset import Dataset
    from rlflow.data.sampler import PromptSampler
    from rlflow.data.scoring import Scorer
    from rlflow.generation.base import GenerationBackend
    from rlflow.model.build import Policy
    from rlflow.model.processor import PromptEncoder
    from rlflow.serve.job import JobServer
    from rlflow.train.checkpoint import Checkpointer
    from rlflow.train.collect import RolloutContext, RolloutSource
    from rlflow.train.metrics import MetricsLog
    from rlflow.train.signals import StopRequest
    from rlflow.train.update import Optimizer


@dataclass
class Trainer:
    recipe: Recipe
    run_dir: Path
    info: parallel.ParallelInfo
    policy: Policy
    reference: Policy | None  # the frozen KL anchor; None when loss.kl_penalty is 0
    encoder: PromptEncoder
    train_data: Dataset
    val_data: Dataset
    sampler: PromptSampler
    backend: GenerationBackend
    checkpointer: Checkpointer
    log: MetricsLog
    stop: StopRequest
    optimizer: Optimizer  # GRPO's (a warm start builds its own, with warm_start.lr)
    scorer: Scorer  # the recipe's rewards; a pool of workers for rewards from user code
    context: RolloutContext  # what the rollouts (and validation) read: the fields above
    rollouts: RolloutSource  # this rank's engine, or the generation ranks
    server: JobServer | None  # colocated, generation.server.enabled: this rank's server
    step: int = 0

    def close(self) -> None:
        """Release what outlives a step: the server, the metrics files, the backend, the reward
        workers."""
        if self.server is not None:
            self.server.stop()
        self.log.close()
        self.backend.close()
        self.scorer.close()


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
            p.vision_cache = cache


def role_of(loaded: LoadedRecipe) -> Role:
    """This rank's role in the job (the allocation rules run first: a bad split is refused)."""
    placement = check_allocation(loaded, int(os.environ.get("WORLD_SIZE", "1")))
    return placement.role(int(os.environ.get("RANK", "0")))


def role_parallelism(recipe: Recipe, role: Role) -> ParallelismConfig:
    """The parallel sizes of a role: the recipe's for training, the engine's for generation."""
    if role == "generate":
        return ParallelismConfig(recipe.generation.tensor_parallel_size, 1, 1, 1, "off")
    return recipe.parallelism


def start_rank(loaded: LoadedRecipe, run_dir: Path) -> parallel.ParallelInfo:
    """What every rank does first: the allocation rules, the process groups of its role, the
    node checks and the seeds."""
    from rlflow.job.preflight import run_preflight

    recipe = loaded.recipe
    # The dry run's allocation rules, on the ranks this job really has (the launcher's
    # WORLD_SIZE, which init_parallel joins): refused before any process group or model.
    placement = check_allocation(loaded, int(os.environ.get("WORLD_SIZE", "1")))
    role = placement.role(int(os.environ.get("RANK", "0")))
    watchdog.beat("startup")  # the process group's rendezvous still counts as start-up
    info = parallel.init_parallel(
        role_parallelism(recipe, role),
        recipe.run.seed,
        timeout_s=recipe.watchdog.collective_timeout_s,
        placement=placement,
    )
    if recipe.preflight.enabled:
        watchdog.beat("preflight")
        run_preflight(recipe.preflight, run_dir, recipe.model.checkpoint, info)
    watchdog.beat("model_load")
    seed_everything(recipe.run.seed)
    return info


def build_scorer(recipe: Recipe) -> Scorer:
    from rlflow.data.scoring import Scorer
    from rlflow.data.user_rewards import search_path

    scoring = recipe.scoring
    return Scorer(
        recipe.rewards,
        accuracy=scoring.accuracy,
        num_workers=scoring.num_workers,
        timeout_s=scoring.timeout_s,
        search_path=search_path(),
    )


def setup(loaded: LoadedRecipe, run_dir: Path) -> Trainer:
    """A training rank's Trainer, complete: nothing is built later."""
    from rlflow.data import PromptSampler, build_dataset
    from rlflow.generation.factory import check_backend_ready, make_backend
    from rlflow.model.build import load_policy, resolve_checkpoint
    from rlflow.model.processor import PromptEncoder
    from rlflow.serve.job import JobServer
    from rlflow.train.checkpoint import Checkpointer
    from rlflow.train.collect import LocalRollouts, RolloutContext
    from rlflow.train.generation_role.remote import Link, RemoteRollouts
    from rlflow.train.metrics import MetricsLog
    from rlflow.train.partial import PartialRollouts
    from rlflow.train.signals import StopRequest
    from rlflow.train.update import Optimizer

    recipe = loaded.recipe
    info = start_rank(loaded, run_dir)
    check_backend_ready(recipe.generation)
    stop = StopRequest(recipe.checkpointing.save_on_signal, recipe.slurm.stop_signal)
    checkpoint = resolve_checkpoint(recipe.model, cache_dir=run_dir / "model")
    separate = parallel.placement() is not None
    # colocated: every rank generates, so every rank serves (separate: the generation ranks)
    server = None if separate else JobServer.announce(recipe, run_dir, checkpoint)
    policy = load_policy(checkpoint, recipe.model, recipe.parallelism, trainable=True)
    reference = None
    if recipe.loss.kl_penalty > 0:
        reference = load_policy(checkpoint, recipe.model, recipe.parallelism, trainable=False)
    share_vision_cache(policy, reference, enabled=recipe.model.freeze_vision)
    encoder = PromptEncoder(checkpoint, recipe.data)
    train_data = build_dataset(recipe.data.train, recipe.data)
    val_data = build_dataset(recipe.data.validation, recipe.data)
    sampler = PromptSampler(len(train_data), recipe.grpo.num_prompts_per_step, recipe.run.seed)
    # Separate placement: this engine (the policy's own) only validates.
    backend = make_backend(
        recipe.generation,
        policy,
        encoder.pad_token_id,
        run_dir,
        recipe.data.max_prompt_tokens,
        role="train",
    )
    log = MetricsLog(
        run_dir,
        enabled=info.is_main,
        tensorboard=recipe.logging.tensorboard,
        progress_bar=recipe.logging.progress_bar,
        total_steps=recipe.grpo.max_num_steps,
        wandb=recipe.logging.wandb,
        config=loaded.data,
    )
    scorer = build_scorer(recipe)
    context = RolloutContext(recipe, info, sampler, train_data, encoder, backend, scorer)
    if separate:
        rollouts = RemoteRollouts(Link(policy, recipe), context)
    elif recipe.environment.kind == "gym":  # NeMo Gym's episodes against the engine's server
        from rlflow.train.gym.source import GymRollouts

        rollouts = GymRollouts(context, policy, checkpoint, run_dir)
    elif recipe.generation.partial_rollouts.enabled:
        rollouts = PartialRollouts(context)  # (separate: on the generation ranks)
    else:
        rollouts = LocalRollouts(context)
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
        optimizer=Optimizer.from_config(policy, recipe.optimizer),
        scorer=scorer,
        context=context,
        rollouts=rollouts,
        server=server,
    )
