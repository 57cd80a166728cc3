"""The GRPO loop: `train()` runs steps; `grpo_step()` is one step in named phases.

    generate -> score -> advantages -> logprobs (trainer and reference) -> update -> log

Each data-parallel rank takes an equal share of the step's prompts and generates all G
completions of each of its prompts, so every group's advantages are computed locally.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from rlflow import parallel
from rlflow.environment.base import step_env_metrics
from rlflow.environment.factory import make_environment
from rlflow.errors import EX_TEMPFAIL, Diagnostic, RlflowError
from rlflow.model.moe import routing
from rlflow.recipe.schema import GRPOConfig
from rlflow.train import checkpoint, grpo, hf_export, rollout_dump, watchdog
from rlflow.train.collect import (
    effective_loss,
    environment_sums,
    sampling,
    sampling_metrics,
    score_rollouts,
)
from rlflow.train.faults import inject_failure
from rlflow.train.metrics import StepTimer
from rlflow.train.rollouts import build_train_batch
from rlflow.train.setup import Trainer
from rlflow.train.update import (
    Batching,
    Optimizer,
    grpo_update,
    rollout_logprobs,
    sft_update,
    update_gives_old_logprobs,
)


def train(t: Trainer) -> int:
    """Run until grpo.max_num_steps; return the exit code (0, or EX_TEMPFAIL on a stop request)."""
    recipe = t.recipe
    resumed = _resume_or_start(t)
    t.rollouts.start(t.step)  # separate placement: the generation ranks get weights and data
    if t.server is not None:  # generation.server.enabled: serve the weights now loaded
        t.server.start(t.policy, t.backend.weight_version)
    if not resumed and recipe.grpo.val_at_start:
        with _paused(t, t.step):
            t.log.log(0, validate(t))
    while t.step < recipe.grpo.max_num_steps:
        step = t.step + 1
        with _paused(t, step):  # the step's weights are version `step` when it ends
            metrics = grpo_step(t, step)
        t.step = step
        last = step == recipe.grpo.max_num_steps
        if validation_due(recipe.grpo, step, last=last):
            with _paused(t, step):
                metrics.update(validate(t))
        t.log.log(step, metrics)
        inject_failure(t.info.job_rank, f"logged{step}")
        stop = t.stop.agreed()
        if stop:
            t.stop.stopping()
        if checkpoint.due(recipe.checkpointing, step, last=last, stop=stop):
            save(t)
        hf_export.after_step(t, step, last)
        if stop and not last:
            t.log.write(
                f"stopping at step {step} on {t.stop.signal_name or 'a peer signal'}: "
                f"checkpoint saved, exit {EX_TEMPFAIL} (requeue)"
            )
            t.rollouts.finish(EX_TEMPFAIL)
            return EX_TEMPFAIL
    t.rollouts.finish(0)
    _summary(t)
    return 0


def _paused(t: Trainer, version: int):
    """The rank's server (if any) waits while the trainer uses the model, then serves
    `version` (rlflow/serve/job.py)."""
    return nullcontext() if t.server is None else t.server.paused(version)


def _summary(t: Trainer) -> None:
    """The line a user looks for at the end of a run: validation accuracy before and after."""
    if not t.info.is_main or not t.log.path.exists():
        return
    from rlflow.train.metrics import read_metrics

    points = [
        (r["step"], r["val/accuracy"]) for r in read_metrics(t.run_dir) if "val/accuracy" in r
    ]
    if len(points) >= 2:
        (first_step, first), (last_step, last) = points[0], points[-1]
        t.log.write(
            f"validation accuracy: {first:.3f} at step {first_step} -> {last:.3f} at step "
            f"{last_step} ({100 * (last - first):+.1f} points); metrics: {t.log.path}"
        )


def grpo_step(t: Trainer, step: int) -> dict[str, float]:
    recipe, info = t.recipe, t.info
    timer = StepTimer(sync=_sync_fn(info.device))
    start = time.perf_counter()
    watchdog.beat("prompts", step)
    inject_failure(info.job_rank, f"step{step}")
    t.policy.vision_cache.clear()  # frozen-tower features live for one step
    rollouts = t.rollouts.collect(step, timer)
    batch = _train_batch(t, rollouts.prompts, rollouts.completions, rollouts.advantages)
    if info.is_main and rollout_dump.due(recipe.logging.rollout_dump_period, step):
        rollout_dump.dump_row(t.run_dir, step, batch, t.encoder.tokenizer)
    batching = Batching.from_config(recipe.optimizer)
    old_logprobs = entropy = ref_logprobs = None
    replay = recipe.loss.router_replay  # MoE: both logprob passes route as generation did
    with timer("logprobs"):
        if not update_gives_old_logprobs(recipe.grpo.num_minibatches):
            old_logprobs, entropy = rollout_logprobs(
                t.policy, batch, batching, with_entropy=True, router_replay=replay
            )
        if t.reference is not None:
            ref_logprobs, _ = rollout_logprobs(
                t.reference, batch, batching, with_entropy=False, router_replay=replay
            )
    with timer("training"):
        update = grpo_update(
            t.policy,
            t.optimizer,
            batch,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            loss_cfg=effective_loss(recipe),
            batching=batching,
            num_minibatches=recipe.grpo.num_minibatches,
        )
    if old_logprobs is None:  # the update's own forward gave them
        old_logprobs, entropy = update.old_logprobs, update.entropy
    t.rollouts.after_update(step, timer)
    metrics = _step_metrics(
        t,
        step=step,
        rollouts=rollouts,
        batch=batch,
        old_logprobs=old_logprobs,
        entropy=entropy,
        update=update.metrics,
        timer=timer,
        step_seconds=time.perf_counter() - start,
    )
    _check_engine_parity(t, step, rollouts.weight_versions, metrics)
    return metrics


def _check_engine_parity(t: Trainer, step: int, versions: list[int], metrics: dict) -> None:
    """Rollouts generated with the very weights this step trains (synchronous GRPO, the first
    async steps) differ from the trainer's logprobs by numerics alone: a mult-prob error above
    `loss.stop_on_mult_prob_error` is a weight-sync or engine bug, and the run stops before
    this step is logged or saved. Every rank decides alike (the error and the freshness are
    reduced over the data-parallel ranks)."""
    limit = t.recipe.loss.stop_on_mult_prob_error
    if limit is None:
        return
    stale = float(any(v != step - 1 for v in versions) or not versions)
    if parallel.all_reduce_sum([stale], parallel.data_parallel_group())[0]:
        return
    error = metrics["train/token_mult_prob_error"]
    if error > limit:
        raise RlflowError(
            Diagnostic(
                "train.engine-mismatch",
                f"step {step}: the generation engine's logprobs of its own tokens differ from "
                f"the trainer's for the same weights (version {step - 1}): "
                f"train/token_mult_prob_error {error:.4g} > loss.stop_on_mult_prob_error "
                f"{limit:g}",
                help="a weight-sync or engine bug, not an effect of RL: report it with the "
                "recipe and the rank logs; loss.stop_on_mult_prob_error=null trains anyway",
            )
        )


def validation_due(cfg: GRPOConfig, step: int, *, last: bool) -> bool:
    """Whether step `step` ends with a validation: every val_period steps, and the last step
    with val_at_end."""
    return bool(cfg.val_period and step % cfg.val_period == 0) or (last and cfg.val_at_end)


@torch.no_grad()
def validate(t: Trainer) -> dict[str, float]:
    """Greedy (val_temperature) answers on the first max_val_samples validation rows."""
    watchdog.beat("validation")

    recipe, info = t.recipe, t.info
    count = min(recipe.grpo.max_val_samples, len(t.val_data))
    samples = [t.val_data[i] for i in range(info.dp_rank, count, info.dp_size)]
    prompts = [t.encoder.encode(s) for s in samples]
    made = make_environment(recipe, t.encoder).rollout(
        t.backend, prompts, samples, sampling(t.context, 0, recipe.generation.val_temperature)
    )
    completions = made.completions
    rewards, _, correct = score_rollouts(t.context, samples, completions, made.reward_texts)
    sums = {
        "val/accuracy": sum(correct),
        "val/reward": sum(rewards),
        "val/response_length": sum(c.num_policy_tokens for c in completions),
        **environment_sums(recipe, made, samples),  # a failed task scores as no answer
    }
    for media in ("image", "video", "text"):
        hits = [c for c, s in zip(correct, samples) if s.media == media]
        sums[f"val/accuracy_{media}"] = sum(hits)
        sums[f"val/count_{media}"] = len(hits)
    totals = dict(
        zip(sums, parallel.all_reduce_sum(list(sums.values()), parallel.data_parallel_group()))
    )
    out = {k: totals[k] / count for k in ("val/accuracy", "val/reward", "val/response_length")}
    out.update(step_env_metrics(totals, "val"))
    for media in ("image", "video", "text"):
        if totals[f"val/count_{media}"]:
            out[f"val/accuracy_{media}"] = (
                totals[f"val/accuracy_{media}"] / totals[f"val/count_{media}"]
            )
    return out


def warm_start(t: Trainer) -> None:
    """Optional supervised steps on (prompt, reference answer) before GRPO."""
    from rlflow.data import PromptSampler

    cfg = t.recipe.warm_start
    if cfg.num_steps == 0:
        return
    optimizer = Optimizer.from_config(t.policy, t.recipe.optimizer, lr=cfg.lr)
    batching = Batching.from_config(t.recipe.optimizer)
    sampler = PromptSampler(len(t.train_data), cfg.batch_size, t.recipe.run.seed + 1)
    environment = make_environment(t.recipe, t.encoder)  # its reference trajectories
    for step in range(1, cfg.num_steps + 1):
        watchdog.beat("warm_start")
        indices = next(sampler)[t.info.dp_rank :: t.info.dp_size]
        samples = [t.train_data[i] for i in indices]
        prompts = [t.encoder.encode(s) for s in samples]
        completions = [environment.reference(s, p) for s, p in zip(samples, prompts)]
        batch = _train_batch(t, prompts, completions, [0.0] * len(prompts))
        t.policy.vision_cache.clear()
        loss = sft_update(t.policy, optimizer, batch, batching)
        if step % 10 == 0 or step == cfg.num_steps:
            t.log.write(f"warm start {step}/{cfg.num_steps}: loss {loss:.4f}")


def save(t: Trainer) -> None:
    watchdog.beat("checkpoint_save")
    t.checkpointer.save(
        t.step,
        t.policy.chunks,
        t.optimizer.inner,
        {"sampler": t.sampler.state_dict()},
        t.rollouts.state_dict(),  # partial rollouts: this rank's rows in flight
    )
    inject_failure(t.info.job_rank, f"saved{t.step}")


def _resume_or_start(t: Trainer) -> bool:
    """Resume from the newest checkpoint in the run directory, or warm start and begin."""
    from rlflow.model.build import copy_weights

    latest = t.checkpointer.latest()
    if latest is None:
        t.log.start(None)  # starting over: an earlier attempt's records (if any) go
        warm_start(t)
        if t.recipe.warm_start.num_steps:
            t.optimizer.reload_weights()  # GRPO's optimizer starts from the warm-started weights
            t.backend.refresh_weights(0)  # backends with their own copy (hf, vllm) must see it
        if t.reference is not None:
            copy_weights(t.policy, t.reference)  # KL is measured against GRPO's starting policy
            t.checkpointer.save_reference(t.reference.chunks)
        return False
    state = t.checkpointer.load(latest, t.policy.chunks, t.optimizer.inner)
    if t.reference is not None and not t.checkpointer.load_reference(t.reference.chunks):
        raise RlflowError(
            Diagnostic(
                "checkpoint.reference-missing",
                f"{t.checkpointer.root / 'reference'} is missing, so the KL reference of "
                f"{latest} cannot be restored",
                help="the reference is saved with the run's first checkpoint; restore it, or "
                "start a new run directory (or set loss.kl_penalty=0)",
            )
        )
    t.sampler.load_state_dict(state["sampler"])
    unfinished = t.rollouts.load_state_dict(t.checkpointer.rank_state(latest))
    t.step = state["step"]
    t.backend.refresh_weights(t.step)
    t.log.start(t.step)  # records after the checkpoint go: those steps run again
    carried = f", {unfinished} unfinished rows continue" if unfinished else ""
    t.log.write(f"resumed from {latest} (step {t.step}){carried}")
    return True


def _train_batch(t: Trainer, prompts, completions, advantages):
    return build_train_batch(
        prompts,
        completions,
        advantages,
        prompt_ids=t.policy.prompt_ids,
        pad_token_id=t.encoder.pad_token_id,
    )


def _step_metrics(
    t: Trainer,
    *,
    step: int,
    rollouts,
    batch,
    old_logprobs,
    entropy,
    update,
    timer,
    step_seconds,
) -> dict[str, float]:
    mask = batch.target_mask
    generated = rollouts.sums
    sums = {
        "train/reward": generated["train/reward"],
        "train/accuracy": generated["train/accuracy"],
        "train/response_length": generated["train/response_length"],
        "train/entropy_sum": float((entropy * mask).sum()),
        "train/tmpe_sum": float(
            grpo.token_mult_prob_error(batch.gen_logprobs, old_logprobs, mask) * mask.sum()
        ),
        "train/tokens": float(mask.sum()),
        "train/real_tokens": float(batch.attention_mask.sum()),
        **{k: v for k, v in generated.items() if k.startswith("train/rollouts")},
        **{k: v for k, v in generated.items() if k.startswith("train/reward_")},
        **{k: v for k, v in generated.items() if k.startswith(("sampling/", "env/"))},
    }
    gap = (batch.gen_logprobs - old_logprobs).abs().exp()
    tmpe_max = float(gap[mask].max()) if mask.any() else 1.0
    totals = dict(
        zip(sums, parallel.all_reduce_sum(list(sums.values()), parallel.data_parallel_group()))
    )
    tokens = max(totals.pop("train/tokens"), 1.0)
    num_rollouts = totals.pop("train/rollouts")
    sampled = sampling_metrics(totals)
    out = {
        k: v / num_rollouts
        for k, v in totals.items()
        if k.startswith(("train/reward", "train/acc", "train/response"))
    }
    out["train/entropy"] = totals["train/entropy_sum"] / tokens
    out["train/token_mult_prob_error"] = totals["train/tmpe_sum"] / tokens
    out["train/token_mult_prob_error_max"] = parallel.all_reduce_max(tmpe_max)
    # Prompt + response tokens of all rollouts on all ranks, no padding: each logprob pass and
    # the update process exactly these (tokens/s and MFU of a phase = this / its time).
    out["train/real_tokens"] = totals["train/real_tokens"]
    out.update(sampled)
    out.update(step_env_metrics(totals, "env"))
    out.update({f"train/{k}": v for k, v in update.items()})
    out.update(routing.step_metrics(t.policy, parallel.data_parallel_group()))
    out.update({f"time/{k}": v for k, v in timer.seconds.items()})
    out.update(t.rollouts.step_metrics(step, rollouts))
    out["time/step"] = step_seconds
    out.update(speed_metrics(totals["train/real_tokens"], tokens, timer.seconds, step_seconds,
                             t.info.world_size))  # fmt: skip
    # Memory at the end of the step and the step's peak: flat across steps means generation's
    # caches and the training buffers are reused, not accumulated.
    if t.info.device.type == "cuda":
        out["memory/allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        out["memory/peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    else:
        import psutil

        out["memory/rss_gib"] = psutil.Process().memory_info().rss / 2**30
    return out


def speed_metrics(real_tokens: float, response_tokens: float, seconds: dict[str, float],
                  step_seconds: float, gpus: int) -> dict[str, float]:  # fmt: skip
    """Throughputs that say what they count (all ranks' rollouts, no padding):
    - speed/step_tokens_per_s(_per_gpu): prompt + response tokens / the whole step's time;
    - speed/generation_tokens_per_s: response tokens / the generation phase's time;
    - speed/logprobs_tokens_per_s, speed/training_tokens_per_s: prompt + response tokens (what
      those passes process) / that phase's time."""

    def rate(tokens: float, phase_seconds: float) -> float:
        return tokens / max(phase_seconds, 1e-9)

    step = rate(real_tokens, step_seconds)
    out = {"speed/step_tokens_per_s": step, "speed/step_tokens_per_s_per_gpu": step / gpus}
    if "generation" in seconds:
        out["speed/generation_tokens_per_s"] = rate(response_tokens, seconds["generation"])
    for phase in ("logprobs", "training"):
        if phase in seconds:
            out[f"speed/{phase}_tokens_per_s"] = rate(real_tokens, seconds[phase])
    return out


def _sync_fn(device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None
