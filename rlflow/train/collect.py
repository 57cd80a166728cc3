"""One step's rollouts: prompts -> generate -> score -> advantages (-> dynamic-sampling rounds).

`collect_rollouts` is everything before the trainer's own forward passes: it returns what to
train on (prompts, completions, advantages) and what was scored, for the step's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlflow.generation.base import Completion, Prompt, SamplingParams
from rlflow.train import grpo


@dataclass
class Rollouts:
    """The rollouts to train on, and the scores of everything generated this step."""

    prompts: list[Prompt]  # one per kept rollout (G per kept prompt)
    completions: list[Completion]
    advantages: list[float]
    # Every rollout generated this step (all rounds), for metrics: reward, accuracy, length.
    rewards: list[float] = field(default_factory=list)
    per_reward: dict[str, list[float]] = field(default_factory=dict)
    accuracy: list[float] = field(default_factory=list)
    generated: list[Completion] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)  # sums, reduced over ranks by the caller


def collect_rollouts(t, step: int, timer) -> Rollouts:
    """Generate G completions for this rank's share of the step's prompts and score them."""
    from rlflow.data.rewards import score

    recipe, info = t.recipe, t.info
    G = recipe.grpo.num_generations_per_prompt
    indices = next(t.sampler)[info.dp_rank :: info.dp_size]
    samples = [t.train_data[i] for i in indices]
    prompts = [t.encoder.encode(s) for s in samples]
    rollout_prompts = [p for p in prompts for _ in range(G)]
    rollout_samples = [s for s in samples for _ in range(G)]
    with timer("generation"):
        completions = t.backend.generate(
            rollout_prompts, sampling(t, step, recipe.generation.temperature)
        )
    with timer("reward"):
        texts = [t.encoder.decode(c.token_ids) for c in completions]
        rewards, per_reward, correct = score(texts, rollout_samples, recipe.rewards)
        advantages = grpo.group_advantages(
            torch.tensor(rewards).view(len(samples), G),
            recipe.grpo.use_leave_one_out_baseline,
            recipe.grpo.normalize_rewards,
        ).flatten()
    return Rollouts(
        prompts=rollout_prompts,
        completions=completions,
        advantages=advantages.tolist(),
        rewards=rewards,
        per_reward=per_reward,
        accuracy=[float(c) for c in correct],
        generated=completions,
    )


def sampling(t, step: int, temperature: float, round_: int = 0) -> SamplingParams:
    gen = t.recipe.generation
    # One seed per (run, step, round, data-parallel rank); tensor-parallel peers share it.
    seed = (t.recipe.run.seed * 1_000_003 + step * 9_973 + round_ * 7_919 + t.info.dp_rank) % 2**31
    return SamplingParams(
        max_new_tokens=gen.max_new_tokens,
        temperature=temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        seed=seed,
        stop_token_ids=(t.encoder.eos_token_id,),
        ignore_eos=False,
    )
