"""One step's rollouts: prompts -> generate -> score -> advantages (-> dynamic-sampling rounds).

`collect_rollouts` is everything before the trainer's own forward passes: it returns what to
train on (prompts, completions, advantages) and what was scored, for the step's metrics.

Dynamic sampling (DAPO, `grpo.dynamic_sampling`): a group whose G rewards are all equal has
zero advantage and teaches nothing, so it is dropped, and more prompts are generated until this
rank has its share of groups with signal. Data-parallel ranks agree on every extra round (one
all-reduce), so they draw the same number of sampler batches and a resumed run draws exactly
the batches the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from rlflow import parallel
from rlflow.environment.base import failure_sums
from rlflow.environment.factory import make_environment
from rlflow.errors import Diagnostic, RlflowError
from rlflow.generation.base import Completion, GenerationBackend, SamplingParams
from rlflow.model.media import Prompt
from rlflow.recipe.schema import Recipe
from rlflow.train import grpo

if TYPE_CHECKING:  # types only
    from rlflow.data.dataset import Dataset
    from rlflow.data.sampler import PromptSampler
    from rlflow.data.scoring import Scorer
    from rlflow.model.processor import PromptEncoder


@dataclass
class Rollouts:
    """The rollouts to train on, and the scores of everything generated this step."""

    prompts: list[Prompt]  # one per kept rollout (G per kept prompt)
    completions: list[Completion]
    advantages: list[float]
    # Sums over every rollout generated this step (all rounds), reduced over ranks by the
    # caller: train/reward, train/accuracy, train/response_length, train/rollouts (the count),
    # train/reward_<name> per reward, and the sampling/* statistics.
    sums: dict[str, float] = field(default_factory=dict)
    # The weights each rollout was generated with: the number of optimizer steps behind them.
    weight_versions: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RolloutContext:
    """What making rollouts reads, and nothing else of the rank: a trainer's (setup.Trainer), or
    a generation rank's (rlflow.train.generation_role.generator). The sampler is read and
    advanced in place; the backend is the rank's engine."""

    recipe: Recipe
    info: parallel.ParallelInfo
    sampler: PromptSampler
    train_data: Dataset
    encoder: PromptEncoder
    backend: GenerationBackend
    scorer: Scorer


class RolloutSource(Protocol):
    """Where a trainer's rollouts come from, step by step (train/loop.py calls these in order):
    its own engine (LocalRollouts, `generation.placement: colocated`) or the generation ranks
    (rlflow.train.generation_role.remote.RemoteRollouts, `separate`)."""

    def start(self, step: int) -> None:
        """Once, after the warm start or the resume, before step `step + 1`."""

    def collect(self, step: int, timer) -> Rollouts:
        """This rank's share of step `step`'s rollouts."""

    def after_update(self, step: int, timer) -> None:
        """The policy's weights changed (version `step`)."""

    def step_metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        """The source's own metrics of the step."""

    def finish(self, exit_code: int) -> None:
        """The run ends with `exit_code`."""

    def state_dict(self) -> dict | None:
        """Rows in flight to checkpoint beside the weights (rlflow.train.partial), or None."""

    def load_state_dict(self, state: dict | None) -> int:
        """A checkpoint's rows in flight back; how many are unfinished."""


@dataclass
class _Group:
    """One prompt's G scored rollouts."""

    prompt: Prompt
    completions: list[Completion]
    rewards: list[float]


def collect_rollouts(t: RolloutContext, step: int, timer) -> Rollouts:
    """This rank's share of the step's prompt groups, generated, scored, with advantages."""
    recipe, info = t.recipe, t.info
    cfg = recipe.grpo
    dynamic = cfg.dynamic_sampling
    want = cfg.num_prompts_per_step // info.dp_size
    scored = Scored()
    kept: list[_Group] = []
    generated_groups = filtered_groups = extra_rounds = 0
    for round_ in range(dynamic.max_extra_rounds + 1 if dynamic.enabled else 1):
        indices = next(t.sampler)[info.dp_rank :: info.dp_size]
        if len(kept) < want:  # a full rank still draws, so every rank's sampler stays in step
            groups = _generate_and_score(t, step, round_, indices, timer, scored)
            generated_groups += len(groups)
            for group in groups:
                empty = no_signal(group.rewards)
                filtered_groups += empty  # counted always: dropped only when enabled
                if not (dynamic.enabled and empty):
                    kept.append(group)
            extra_rounds = round_
        else:  # full: an expert-parallel engine's peers still need this rank in their passes
            t.backend.generate([], sampling(t, step, recipe.generation.temperature, round_))
        if not dynamic.enabled:
            break
        if not parallel.all_reduce_max(float(len(kept) < want), parallel.data_parallel_group()):
            break
    else:
        _raise_exhausted(kept, want, dynamic.max_extra_rounds, generated_groups, filtered_groups)
    kept = kept[:want]
    if not kept:  # every group had a failed task (on_task_failure: continue)
        raise RlflowError(
            Diagnostic(
                "environment.no-trajectories",
                f"step {step}: every prompt group of data-parallel rank {info.dp_rank} had a "
                f"failed environment task ({scored.env_sums.get('env/failed_tasks', 0):.0f} "
                "failed): nothing to train on",
                help="see env/failed_tasks/<reason> in the metrics; environment.on_task_failure: "
                "stop names the first failure and its row",
            )
        )
    with timer("advantages"):
        advantages = grpo.group_advantages(
            torch.tensor([g.rewards for g in kept]),
            cfg.use_leave_one_out_baseline,
            cfg.normalize_rewards,
        ).flatten()
    completions = [c for g in kept for c in g.completions]
    stats = {
        "sampling/groups_generated": float(generated_groups),
        "sampling/groups_filtered": float(filtered_groups),
        # every rank took the same rounds: counted once, so the sum over ranks is the count
        "sampling/extra_rounds": float(extra_rounds) if info.dp_rank == 0 else 0.0,
        "sampling/generated_tokens": float(sum(c.num_policy_tokens for c in scored.generated)),
        "sampling/preempted_rows": float(scored.preempted),
    }
    return Rollouts(
        prompts=[g.prompt for g in kept for _ in g.completions],
        completions=completions,
        advantages=advantages.tolist(),
        sums={**scored.sums(), **stats},
        weight_versions=[t.backend.weight_version] * len(completions),
    )


@dataclass
class Scored:
    """Everything generated this step, scored (all rounds, kept or not)."""

    rewards: list[float] = field(default_factory=list)
    per_reward: dict[str, list[float]] = field(default_factory=dict)
    accuracy: list[float] = field(default_factory=list)
    generated: list[Completion] = field(default_factory=list)
    preempted: int = 0  # rows the engine preempted (rlflow/generation/megatron/schedule.py)
    env_sums: dict[str, float] = field(default_factory=dict)  # the environment's env/* sums

    def sums(self) -> dict[str, float]:
        return {
            "train/reward": sum(self.rewards),
            "train/accuracy": sum(self.accuracy),
            # the policy's tokens: a trajectory's environment tokens are not its response
            "train/response_length": sum(c.num_policy_tokens for c in self.generated),
            "train/rollouts": float(len(self.rewards)),
            **{f"train/reward_{name}": sum(values) for name, values in self.per_reward.items()},
            **self.env_sums,
        }


def sampling_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Step metrics from the rank-summed `sampling/*` sums. filtered_fraction is the share of
    generated groups whose rewards were all equal (dropped when dynamic sampling is on)."""
    generated = max(totals["sampling/groups_generated"], 1.0)
    return {
        "train/filtered_fraction": totals["sampling/groups_filtered"] / generated,
        "train/extra_rounds": totals["sampling/extra_rounds"],
        "train/generated_tokens": totals["sampling/generated_tokens"],
        # rows the megatron engine's KV cache could not hold: generated again, same tokens
        "train/preempted_rows": totals["sampling/preempted_rows"],
    }


def _generate_and_score(
    t: RolloutContext, step: int, round_: int, indices, timer, out: Scored
) -> list[_Group]:
    recipe = t.recipe
    G = recipe.grpo.num_generations_per_prompt
    samples = [t.train_data[i] for i in indices]
    prompts = [t.encoder.encode(s) for s in samples]
    rollout_prompts = [p for p in prompts for _ in range(G)]
    rollout_samples = [s for s in samples for _ in range(G)]
    with timer("generation"):
        made = make_environment(recipe, t.encoder).rollout(
            t.backend,
            rollout_prompts,
            rollout_samples,
            sampling(t, step, recipe.generation.temperature, round_),
        )
    completions = made.completions
    out.preempted += getattr(t.backend, "last_timings", {}).get("preempted", 0)
    for key, value in environment_sums(recipe, made, rollout_samples).items():
        out.env_sums[key] = out.env_sums.get(key, 0.0) + value
    with timer("reward"):
        rewards, per_reward, accuracy = score_rollouts(
            t, rollout_samples, completions, made.reward_texts
        )
        penalty = shaping_penalty(recipe, completions)
        if penalty is not None:
            rewards = [r + p for r, p in zip(rewards, penalty, strict=True)]
            per_reward["overlong_penalty"] = penalty
    out.rewards += rewards
    out.accuracy += accuracy
    out.generated += completions
    for name, values in per_reward.items():
        out.per_reward.setdefault(name, []).extend(values)
    return [  # continue: a group with a failed task is left out (GRPO needs the whole group)
        _Group(prompts[i], completions[i * G : (i + 1) * G], rewards[i * G : (i + 1) * G])
        for i in range(len(samples))
        if not any(k in made.failed for k in range(i * G, (i + 1) * G))
    ]


def environment_sums(recipe, made, samples) -> dict[str, float]:
    """The environment's env/* sums with its failed tasks counted (every kind but single_turn,
    which has no tasks that can fail); a failed task ends the run here with
    `environment.on_task_failure: stop`."""
    if recipe.environment.kind == "single_turn":
        return made.sums
    on_task_failure = recipe.environment.on_task_failure
    if made.failed and on_task_failure == "stop":
        _raise_failed(made.failed, samples)
    return {**made.sums, **failure_sums(made.failed)}


def _raise_failed(failed: dict[int, tuple[str, str]], samples) -> None:
    index, (reason, detail) = min(failed.items())
    raise RlflowError(
        Diagnostic(
            "environment.task-failed",
            f"the environment's task on row `{samples[index].id}` failed ({reason}): {detail}"
            + (f"; {len(failed) - 1} more failed in this pass" if len(failed) > 1 else ""),
            help="environment.on_task_failure: continue leaves a failed task's prompt group out "
            "of the step (counted in env/failed_tasks); environment.task_timeout_s bounds a "
            "task's tool calls",
        )
    )


def no_signal(rewards: list[float]) -> bool:
    """Whether one group's rewards are all equal (zero advantage: nothing to learn)."""
    # float32, as group_advantages sees them: "all equal" here means zero advantage there
    return bool(grpo.zero_variance_groups(torch.tensor([rewards]))[0])


def _raise_exhausted(kept, want, rounds, generated, filtered) -> None:
    kept_all, want_all = parallel.all_reduce_sum(
        [float(min(len(kept), want)), float(want)], parallel.data_parallel_group()
    )
    raise RlflowError(
        Diagnostic(
            "grpo.dynamic-sampling-exhausted",
            f"dynamic sampling: after {rounds} extra generation rounds only {kept_all:.0f} of "
            f"{want_all:.0f} prompt groups have rewards that differ ({filtered} of {generated} "
            "groups on this rank had all-equal rewards)",
            help="raise grpo.dynamic_sampling.max_extra_rounds, use more generations per prompt "
            "(grpo.num_generations_per_prompt), or check the rewards: all-equal groups mean the "
            "task is too easy or too hard for the policy, or a reward is constant",
        )
    )


def score_rollouts(
    t: RolloutContext, samples, completions, texts: list[str]
) -> tuple[list[float], dict[str, list[float]], list]:
    """(weighted reward, each reward and component, accuracy) of each rollout; `texts` are
    what the rewards read as the completions (the environment's EnvRollouts.reward_texts)."""
    from rlflow.data.rewards import RewardBatch

    suffix = t.recipe.data.prompt_suffix
    batch = RewardBatch.build(
        [s.question + suffix for s in samples],
        texts,
        [c.num_policy_tokens for c in completions],
        [c.finish_reason for c in completions],
        samples,
    )
    scores = t.scorer.score(batch)
    return scores.totals, scores.components, scores.accuracy


def shaping_penalty(recipe, completions) -> list[float] | None:
    """DAPO's overlong penalty per rollout (added to the reward), or None when it is off."""
    cfg = recipe.loss.overlong_penalty
    if not cfg.enabled:
        return None
    lengths = torch.tensor([c.num_policy_tokens for c in completions])
    penalty = grpo.overlong_penalty(
        lengths, recipe.generation.max_new_tokens, cfg.buffer_tokens, cfg.penalty
    )
    return penalty.tolist()


def effective_loss(recipe):
    """recipe.loss with importance_sampling.mode `auto` resolved for the rollouts (the rule is
    rlflow.recipe.inert.sampling_mode, which the recipe checks ask too)."""
    from rlflow.recipe.inert import sampling_mode

    cfg = recipe.loss.importance_sampling
    mode = sampling_mode(recipe)
    return dataclasses.replace(recipe.loss, importance_sampling=dataclasses.replace(cfg, mode=mode))


def sampling(t: RolloutContext, step: int, temperature: float, round_: int = 0) -> SamplingParams:
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


class LocalRollouts:
    """Colocated placement: every rank generates its own share with the policy's own engine,
    and after each update the backend is told the weights changed
    (rlflow.train.generation_role.remote has the separate placement's counterpart)."""

    def __init__(self, context: RolloutContext):
        self.context = context

    def start(self, step: int) -> None:
        """Nothing to hand over: the engine reads the policy's weights."""

    def collect(self, step: int, timer) -> Rollouts:
        return collect_rollouts(self.context, step, timer)

    def after_update(self, step: int, timer) -> None:
        with timer("weight_refresh"):
            self.context.backend.refresh_weights(step)

    def step_metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        return {}

    def finish(self, exit_code: int) -> None:
        """Nobody else to tell."""

    def state_dict(self) -> dict | None:
        return None  # every step's rows finish within it

    def load_state_dict(self, state: dict | None) -> int:
        return 0  # (a partial-rollouts checkpoint's rows are not continued with it off)
