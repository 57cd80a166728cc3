"""`environment.kind: gym`: a step's rollouts are NeMo Gym episodes against rlflow's server.

`start()` (after the policy's weights are loaded, restored or synced): the engine's OpenAI
server in-process (rlflow/serve/runner.py, sized by `generation.server`) on the leader (rank 0),
or with `generation.placement: separate` on every generation rank (the first is the leader);
then, on the leader, Gym's servers (servers.py) with Gym's `vllm_model` pointed at every server
(it spreads Gym's sessions over them). `collect()`: the leader posts the step's task rows to the
agent's `/run` (episodes.py: what Gym's rollout collection does, each task bounded by
`environment.task_timeout_s`), turns each answer into a Completion (trajectory.py), computes the
group advantages and sends every data-parallel rank its share (`collect_all()`: the leading
generation rank keeps them all for the trainers, while the other generation ranks serve the
turns in `serve_step()`: rlflow/train/generation_role/generator.py). `after_update()`: the
server serves the new weights from the next request on. `finish()` stops Gym's servers, then
ours.

A failed task (timeout, a server that died, HTTP error, malformed JSON, discontinuous token
ids) is counted in `env/failed_tasks` and `env/failed_tasks/<reason>`; its prompt's group is
left out of the step (`environment.on_task_failure: continue`) or the run ends naming it (`stop`).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import torch

from rlflow import parallel
from rlflow.errors import Diagnostic, RlflowError
from rlflow.model.media import Media, Prompt
from rlflow.train import grpo, watchdog
from rlflow.train.collect import RolloutContext, Rollouts
from rlflow.train.gym.episodes import Episodes, env_metrics, failures_seen
from rlflow.train.gym.servers import GymServers, gym_config, servers_to_start
from rlflow.train.gym.tasks import load_tasks, request_row, step_tasks, tasks_path
from rlflow.train.gym.trajectory import TaskFailed, Trajectory

MODEL_NAME = "policy"  # the name Gym's vllm_model sends as `model`


class GymRollouts:
    """The RolloutSource of `environment.kind: gym` (rlflow/train/collect.py has the protocol)."""

    def __init__(
        self, context: RolloutContext, policy, checkpoint: Path, run_dir: Path, *,
        leader: bool | None = None, replicas=None, engine_ranks=None,
    ):  # fmt: skip
        self.context, self.policy, self.checkpoint = context, policy, checkpoint
        # the rank that runs Gym (and serves): job rank 0 unless told
        self.leader = context.info.is_main if leader is None else leader
        # the serving generation ranks' group (rlflow.parallel.CrossGroup), or None
        self.replicas = replicas
        # a tensor-parallel engine's ranks (CrossGroup): the first serves and sends the others
        # its plans (rlflow/serve/tensor_parallel.py); None without tensor parallelism
        self.engine_ranks = engine_ranks
        self.follower = None  # an engine's other rank: rlflow.serve.tensor_parallel.Follower
        self.log_dir = run_dir / "gym"
        self.env = context.recipe.environment
        self.cfg = self.env.gym
        self.thread = self.servers = None
        self.tasks: list[dict] = []
        self.episodes: Episodes | None = None  # the leader's: posts the task rows to Gym
        self.policy_urls: list[str] = []  # the servers Gym's vllm_model spreads sessions over
        self._requests = 0  # this rank's server's requests, as last counted
        self.metrics: dict[str, float] = {}
        # prompt ids -> the Prompt the server made of them (with its images: the trainer's
        # forward needs the pixels), filled by the server's encoder, emptied each step
        self.prompts: dict[tuple[int, ...], Prompt] = {}

    def start(self, step: int) -> None:
        if not (self.leader or self.replicas or self.engine_ranks):
            return
        from rlflow.serve.runner import ServerThread, following_engine, served_engine
        from rlflow.serve.tensor_parallel import PlanSender

        recipe = self.context.recipe
        server = recipe.generation.server
        plans = None
        if self.engine_ranks is not None:
            if self.context.info.job_rank != self.engine_ranks.ranks[0]:  # follows, serves not
                pad = self.context.encoder.pad_token_id
                self.follower = following_engine(self.policy, pad, recipe, self.engine_ranks)
                return
            plans = PlanSender(self.engine_ranks)
        served = served_engine(self.policy, self.checkpoint, recipe, MODEL_NAME, plans=plans)
        served.engine.weight_version = step
        _remember_prompts(served.prompts, self.prompts)
        # several ranks of a node: each listens on its own port (0: each picks a free one)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        port = server.port + local if server.port else 0
        self.thread = ServerThread(
            served, server.host, port, server.max_connections, server.idle_timeout_s
        ).start()
        url = self.thread.url
        if self.thread.host in ("0.0.0.0", "::", ""):  # every interface: reached by name
            url = f"http://{socket.getfqdn()}:{self.thread.port}"
        urls = [url]
        if self.replicas is not None:
            urls = self.replicas.all_gather_object(url, keep_alive=watchdog.beat)
        if not self.leader:
            return
        self.policy_urls = urls
        config = gym_config(self.cfg, urls, MODEL_NAME)
        self.tasks = load_tasks(tasks_path(config, self.cfg))
        servers = servers_to_start(config, self.cfg)
        self.servers = GymServers(config, servers, self.log_dir, self.cfg.ready_timeout_s)
        try:
            self.servers.start()  # stops what it started when it fails
        except BaseException:
            self.finish(1)
            raise
        agent_url = next(s.url for s in servers if s.name == self.cfg.agent)
        self.episodes = Episodes(self.env, agent_url, self.servers, self.log_dir)

    def collect(self, step: int, timer) -> Rollouts:
        """A training rank's share of the step's trajectories."""
        info = self.context.info
        groups = self._groups(step, timer) if self.leader else None
        groups, self.metrics = parallel.broadcast_object((groups, self.metrics))
        mine = groups[info.dp_rank :: info.dp_size]
        return self._rollouts(mine)

    def collect_all(self, step: int, timer) -> Rollouts:
        """Every trajectory of the step, on the leader alone (a generation rank's batch)."""
        return self._rollouts(self._groups(step, timer))

    def serve_step(self, timer) -> None:
        """A generation rank other than the leader: serve Gym's turns until the leader's tasks
        ended, then hand it the prompts with images this rank's server made. An engine's
        follower: run its server's plans until the server says the step is over."""
        if self.follower is not None:
            with timer("environment"):
                self.follower.follow(keep_alive=watchdog.beat)
            return
        engine = self.thread.served.engine
        engine.resume_followers()
        with timer("environment"):  # the leader says when its tasks ended
            self.replicas.broadcast_object(None, self.replicas.ranks[0], keep_alive=watchdog.beat)
        engine.release_followers()
        self.replicas.all_gather_object((dict(self.prompts), self._new_requests()))
        self.prompts.clear()

    def _new_requests(self) -> int:
        """Requests (model turns) this rank's server took since the last call."""
        total = self.thread.served.engine.stats.requests
        new, self._requests = total - self._requests, total
        return new

    def _groups(self, step: int, timer) -> list[list[tuple[Prompt, Trajectory]]]:
        try:
            with timer("environment"):
                return self._run_step(step)
        except BaseException:
            self.finish(1)  # the rank leaves with os._exit: stop Gym's servers now
            raise

    def after_update(self, step: int, timer) -> None:
        if self.thread is not None:
            with timer("weight_refresh"):
                self.thread.served.engine.update_weights(None, step)
        elif self.follower is not None:  # (the leader's engine does the same between steps)
            self.follower.batch.decoder.requantize()

    def step_metrics(self, step: int, rollouts: Rollouts) -> dict[str, float]:
        return dict(self.metrics)

    def finish(self, exit_code: int) -> None:
        if self.servers is not None:
            self.servers.stop()
            self.servers = None
        if self.thread is not None:
            self.thread.stop()
            self.thread = None

    # --- the leader -----------------------------------------------------------------------------

    def _run_step(self, step: int) -> list[list[tuple[Prompt, Trajectory]]]:
        recipe = self.context.recipe
        G = recipe.grpo.num_generations_per_prompt
        picked = step_tasks(
            len(self.tasks), step, recipe.grpo.num_prompts_per_step, recipe.run.seed
        )
        rows = [request_row(self.tasks[i], recipe.generation) for i in picked for _ in range(G)]
        engine = self.thread.served.engine
        version = engine.weight_version
        start = time.perf_counter()
        engine.resume_followers()
        results = self.episodes.run(rows, version)
        engine.release_followers()  # the engine's other ranks: the step is over
        served = [self._new_requests()]  # the turns each server took in this step
        if self.replicas is not None:  # the tasks ended: the prompts the other servers made
            self.replicas.broadcast_object(None, self.replicas.ranks[0])
            gathered = self.replicas.all_gather_object(({}, served[0]))
            for made, _ in gathered:
                self.prompts.update(made)
            served = [turns for _, turns in gathered]
        failed: dict[str, int] = {}
        example: dict[str, str] = {}  # reason -> the first failure's detail
        malformed: dict[str, int] = {}
        groups, turns, left_out = [], [], 0
        for g, task in enumerate(picked):
            group = results[g * G : (g + 1) * G]
            for item in group:
                if isinstance(item, TaskFailed):
                    failed[item.reason] = failed.get(item.reason, 0) + 1
                    example.setdefault(item.reason, item.detail)
                    self.episodes.on_failure(item, task)
                else:
                    turns.append(item.turns)
                    left_out += item.left_out
                    for reason, n in item.malformed.items():
                        malformed[reason] = malformed.get(reason, 0) + n
            if not any(isinstance(item, TaskFailed) for item in group):
                name = f"gym-{step}-{task}"
                groups.append([(_prompt(t, name, self.prompts), t) for t in group])
        self.prompts.clear()
        if failed and groups:  # on_task_failure: continue: say why, once per reason and step
            print(failures_seen(step, failed, example, self.log_dir).render() + "\n",
                  file=sys.stderr, flush=True)  # fmt: skip
        seconds = time.perf_counter() - start
        self.metrics = env_metrics(failed, malformed, turns, len(rows), seconds, left_out)
        self.metrics["env/policy_servers"] = float(len(self.policy_urls))
        self.metrics["env/policy_server_turns_min"] = float(min(served))
        if not groups:
            raise RlflowError(
                Diagnostic(
                    "gym.no-trajectories",
                    f"step {step}: every NeMo Gym task group failed ({failed}); first of "
                    f"each: {example}",
                    help=f"see the Gym servers' logs in {self.log_dir}",
                )
            )
        return groups

    # --- every rank -----------------------------------------------------------------------------

    def _rollouts(self, groups: list[list[tuple[Prompt, Trajectory]]]) -> Rollouts:
        cfg = self.context.recipe.grpo
        rewards = torch.tensor([[t.reward for _, t in g] for g in groups], dtype=torch.float32)
        advantages = grpo.group_advantages(
            rewards.reshape(len(groups), -1), cfg.use_leave_one_out_baseline, cfg.normalize_rewards
        ).flatten()
        flat = [t for g in groups for _, t in g]
        prompts = [p for g in groups for p, _ in g]
        completions = [t.completion for t in flat]
        trained = [sum(c.loss_mask) for c in completions]
        sums = {
            "train/reward": sum(t.reward for t in flat),
            "train/accuracy": float(sum(t.reward > 0 for t in flat)),
            "train/response_length": float(sum(trained)),
            "train/rollouts": float(len(flat)),
            "sampling/groups_generated": float(len(groups)),
            "sampling/groups_filtered": float(int(grpo.zero_variance_groups(rewards).sum())),
            "sampling/extra_rounds": 0.0,
            "sampling/generated_tokens": float(sum(trained)),
            "sampling/preempted_rows": 0.0,
        }
        versions = [c.token_versions[0] if c.token_versions else 0 for c in completions]
        return Rollouts(prompts, completions, advantages.tolist(), sums, versions)


def _remember_prompts(cache, into: dict) -> None:
    """The server's prompt cache (rlflow/serve/prompts.py), also keeping each prompt with images
    it hands out, encoded or cached (by its ids)."""
    get = cache.get

    def remembering(chat):
        prompt = get(chat)
        if prompt.media.num_images or prompt.media.num_videos:
            into[tuple(prompt.token_ids)] = prompt
        return prompt

    cache.get = remembering


def _prompt(trajectory: Trajectory, name: str, made: dict) -> Prompt:
    """The first turn's prompt as the server made it (a text one if it had no images)."""
    ids = tuple(trajectory.prompt_ids)
    prompt = made.get(ids)
    if prompt is not None:
        return Prompt(name, prompt.text, ids, prompt.media)
    return Prompt(name, "", ids, Media())
