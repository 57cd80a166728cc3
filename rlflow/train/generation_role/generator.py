"""A generation rank (`generation.placement: separate`): the Megatron generation engine, serving
the trainers rollouts until they say stop.

Each generation rank holds the policy with the generation engine's own tensor-parallel size
(generation.tensor_parallel_size), the training data, the prompt sampler and the rewards: it
does everything of a step before the trainer's forward passes (rlflow.train.collect: generate,
score, advantages, dynamic sampling) and hands the first generation rank's merge of all replicas
to the trainers. The order of messages and which weights generate which batch are the protocol
in rlflow.train.generation_role.remote; this module is its generation side:

    start: weights of the trainer's step S, the sampler's state
    until "stop": order k -> (generate batch k if not ready) -> send it -> generate ahead
                  -> if the weights of k are due: "ready", receive them, fingerprints

With `environment.kind: gym` the generation ranks serve NeMo Gym instead of generating from
the dataset: after the first weights arrive each starts its engine's OpenAI server, and the
first one starts Gym's servers (Gym's vllm_model spreading sessions over every server). Each
batch is the step's Gym episodes, run by the first generation rank while the others serve
(rlflow/train/gym/); each weight sync moves every server to the new version, so every turn
records the weights that generated it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from rlflow import parallel
from rlflow.errors import Diagnostic, RlflowError
from rlflow.recipe.load import LoadedRecipe
from rlflow.train import watchdog
from rlflow.train.collect import RolloutContext, Rollouts, collect_rollouts
from rlflow.train.faults import inject_failure, skewed
from rlflow.train.generation_role.remote import Link, RolloutBatch, Schedule
from rlflow.train.metrics import StepTimer


@dataclass
class Generator:
    """A generation rank's state: what its rollouts read (the same context a trainer's do), and
    its own parts."""

    context: RolloutContext
    policy: object
    stop: object
    link: Link
    server: object  # rlflow.serve.job.JobServer (generation.server.enabled), or None
    gym: object = None  # rlflow.train.gym.source.GymRollouts (environment.kind: gym), or None
    partial: object = None  # rlflow.train.partial.PartialRollouts (partial rollouts), or None

    def close(self) -> None:
        if self.gym is not None:
            self.gym.finish(0)
        if self.server is not None:
            self.server.stop()
        self.context.backend.close()
        self.context.scorer.close()


def setup_generator(loaded: LoadedRecipe, run_dir: Path) -> Generator:
    from rlflow.data import PromptSampler, build_dataset
    from rlflow.generation.factory import make_backend
    from rlflow.model.build import load_policy, resolve_checkpoint
    from rlflow.model.processor import PromptEncoder
    from rlflow.serve.job import JobServer
    from rlflow.train import setup
    from rlflow.train.signals import StopRequest

    recipe = loaded.recipe
    info = setup.start_rank(loaded, run_dir)
    # The trainers decide when to stop; a time-limit warning here is only noted.
    stop = StopRequest(recipe.checkpointing.save_on_signal, recipe.slurm.stop_signal)
    checkpoint = resolve_checkpoint(recipe.model, cache_dir=run_dir / "model")
    server = JobServer.announce(recipe, run_dir, checkpoint)
    par = setup.role_parallelism(recipe, "generate")
    policy = load_policy(checkpoint, recipe.model, par, trainable=False)
    setup.share_vision_cache(policy, None, enabled=recipe.model.freeze_vision)
    encoder = PromptEncoder(checkpoint, recipe.data)
    train_data = build_dataset(recipe.data.train, recipe.data)
    backend = make_backend(  # a generation rank holds nothing else: it keeps its KV cache
        recipe.generation,
        policy,
        encoder.pad_token_id,
        run_dir,
        recipe.data.max_prompt_tokens,
        role="generate",
    )
    sampler = PromptSampler(len(train_data), recipe.grpo.num_prompts_per_step, recipe.run.seed)
    g = Generator(
        context=RolloutContext(
            recipe, info, sampler, train_data, encoder, backend, setup.build_scorer(recipe)
        ),
        policy=policy,
        stop=stop,
        link=Link(policy, recipe),
        server=server,
    )
    if recipe.generation.partial_rollouts.enabled:  # rows continue across batches
        from rlflow.train.partial import PartialRollouts

        g.partial = PartialRollouts(g.context)
    if recipe.environment.kind == "gym":  # Gym's episodes against this rank's engine
        from rlflow.train.gym.source import GymRollouts

        leader = info.job_rank == g.link.leader
        g.gym = GymRollouts(
            g.context, policy, checkpoint, run_dir, leader=leader,
            replicas=g.link.generators, engine_ranks=g.link.engine_ranks,
        )  # fmt: skip
    watchdog.beat("setup")
    return g


def serve(g: Generator) -> int:
    """Rollouts for the trainers until they say stop; their exit code."""
    link = g.link
    watchdog.beat("wait_trainer")
    start = link.message(src=0)
    g.context.sampler.load_state_dict(start["sampler"])
    if g.partial is not None and start.get("partial"):  # resumed: this replica's rows in flight
        g.partial.load_state_dict(start["partial"][g.context.info.dp_rank])
    _receive_weights(g, start["step"])
    if g.server is not None:  # generation.server.enabled: serve the weights now synced
        g.server.start(g.policy, g.context.backend.weight_version)
    try:
        return _serve(g, link, start)
    except BaseException:
        if g.gym is not None:  # the rank leaves with os._exit: stop Gym's servers now
            g.gym.finish(1)
            g.gym = None
        raise


def _serve(g: Generator, link: Link, start: dict) -> int:
    if g.gym is not None:
        g.gym.start(start["step"])
    schedule = Schedule(
        g.context.recipe.async_grpo.max_staleness,
        start["step"],
        g.context.recipe.grpo.max_num_steps,
    )
    ready: dict[int, RolloutBatch | None] = {}
    upcoming = start["step"] + 1
    while True:
        watchdog.beat("wait_trainer")
        order = link.message(src=0)
        if "stop" in order:
            return order["stop"]
        step = order["want"]
        while upcoming <= step:  # not generated ahead (synchronous, or the first batch)
            with _paused(g):
                ready[upcoming], upcoming = _batch(g, upcoming, schedule), upcoming + 1
        batch = ready.pop(step)
        if link.rollouts is not None:
            watchdog.beat("send_rollouts", step)
            link.rollouts.broadcast_object(batch, link.leader)
        while (
            upcoming <= schedule.ahead(step) and schedule.version_for(upcoming) <= link.sync.version
        ):
            with _paused(g):
                ready[upcoming], upcoming = _batch(g, upcoming, schedule), upcoming + 1
        if schedule.sync_after(step):
            watchdog.beat("wait_trainer")
            link.message("ready", src=link.leader)
            with _paused(g, step):
                _receive_weights(g, step)


def _paused(g: Generator, version: int | None = None):
    """The rank's server (if any) waits while the rank uses its model, then serves `version`
    (default: the weights it holds; rlflow/serve/job.py)."""
    if g.server is None:
        return nullcontext()
    return g.server.paused(g.context.backend.weight_version if version is None else version)


def _receive_weights(g: Generator, version: int) -> None:
    watchdog.beat("weight_sync")
    g.link.weights(version)
    if skewed(g.context.info.job_rank, f"sync{version}"):  # tests: a wrong cut, unseen
        for param in g.policy.core.parameters():
            param.data.neg_()
    # in place: the engine's views of the weights are current
    g.context.backend.refresh_weights(version)
    if g.gym is not None:  # Gym's turns: the new version next (once its server started)
        g.gym.after_update(version, StepTimer())


def _batch(g: Generator, step: int, schedule: Schedule) -> RolloutBatch | None:
    """Batch `step`, generated with the weights the schedule gives it; the whole batch on the
    first generation rank (None on the others)."""
    info = g.context.info
    watchdog.beat("generation", step)
    inject_failure(info.job_rank, f"step{step}")
    if g.context.backend.weight_version != schedule.version_for(step):
        raise RlflowError(
            Diagnostic(
                "async.schedule",
                f"generation rank {info.job_rank} holds weights of version "
                f"{g.context.backend.weight_version} for batch {step}; the schedule says "
                f"{schedule.version_for(step)}",
            )
        )
    g.policy.vision_cache.clear()  # frozen-tower features live for one batch
    timer = StepTimer(sync=_sync_fn(info.device))
    metrics, rollouts = {}, None
    if g.gym is not None and g.gym.leader:  # the step's Gym episodes, all of them
        rollouts = g.gym.collect_all(step, timer)
        metrics = g.gym.step_metrics(step, rollouts)
    elif g.gym is not None:  # serve the leader's episodes' turns (or follow a server's plans)
        g.gym.serve_step(timer)
    elif g.partial is not None:  # complete groups; the cut rows continue in the next batch
        rollouts = g.partial.collect(step, timer)
        metrics = g.partial.step_metrics(step, rollouts)
    else:
        rollouts = collect_rollouts(g.context, step, timer)
    sampler_state = g.context.sampler.state_dict()
    partial = g.partial.state_dict() if g.partial is not None else None
    mine = (rollouts, partial, info.dp_rank) if info.tp_rank == 0 else None
    gathered = [r for r in parallel.all_gather_objects(mine) if r is not None]
    if info.job_rank != g.link.leader:
        return None
    gathered.sort(key=lambda r: r[2])  # replica order: what a resumed replica takes back
    replicas = [r[0] for r in gathered if r[0] is not None]
    size = g.context.recipe.grpo.num_generations_per_prompt
    batch = _merged(
        step, g.context.backend.weight_version, replicas, size, sampler_state, timer.seconds
    )
    batch.metrics = metrics
    if g.partial is not None:
        batch.partial = [r[1] for r in gathered]
    return batch


def _merged(
    step, version, replicas: list[Rollouts], size: int, sampler_state, seconds
) -> RolloutBatch:
    """One batch from every generation replica's rollouts: groups in prompt order (replica r
    drew prompts r, r + R, ...), sums added up."""
    per_replica = [_groups(r, size) for r in replicas]
    groups = [
        per_replica[r][i]
        for i in range(max(len(g) for g in per_replica))
        for r in range(len(per_replica))
        if i < len(per_replica[r])
    ]
    sums = {k: sum(r.sums[k] for r in replicas) for k in replicas[0].sums}
    return RolloutBatch(step, version, groups, sums, sampler_state, dict(seconds))


def _groups(rollouts: Rollouts, size: int) -> list:
    """(prompt, its completions, their advantages) per prompt group of `size` rollouts."""
    return [
        (rollouts.prompts[i], rollouts.completions[i : i + size], rollouts.advantages[i : i + size])
        for i in range(0, len(rollouts.prompts), size)
    ]


def _sync_fn(device):
    if device.type == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(device)
    return None
