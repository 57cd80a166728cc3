"""The routers' expert choices in the trainer: replayed, compared and counted (router replay).

MoE RL needs the experts that generated a token to be the ones the trainer scores it with:
otherwise a token's logprob is computed through other experts than the ones that produced it,
and on Qwen3-30B-A3B 3 of 3 GRPO runs collapsed that way (NVIDIA/Megatron-LM#4168). rlflow's
generation engine records the top-k choices of every prompt and generated token
(rlflow/generation/megatron/moe_decode.py); they travel with the rollouts (`TrainBatch.routing`,
[rows, length, layers, k], -1 where there is none: padding, and the last generated token,
which never went through the model) and, with `loss.router_replay`, both logprob passes and
the update route each token to its recorded experts ("R3").

`RouterHook` takes the place of megatron-core's `RouterReplay` on every router (megatron-core
calls it for the top-k selection, rlflow/model/moe/experts.py installs it). Outside a `plan(...)`
block it computes megatron's own top-k. Inside one it

* compares the router's own choice with the recorded one (`agreement`: the share of
  token x layer pairs whose expert sets are identical, and the share of single choices);
* replays: the recorded experts replace the router's choice, and their probabilities are the
  router's scores at those experts (so gradients still reach the router);
* counts the tokens each expert receives (`load`: the expert load per layer).

Token order is the routers': [sequence, batch] flattened, i.e. the packed row order of
rlflow/model/packed_forward.py, or position-major for a padded batch (`padded_order`).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch


@dataclass
class Plan:
    """What the routers do within one forward, and what they report."""

    targets: torch.Tensor | None  # [tokens, layers, k] recorded experts, -1: the router's own
    replay: bool  # route to the targets (else only compare with them)
    count_load: bool
    # Sums kept on the device (no host sync per layer): [same set, same choices, compared]
    counts: torch.Tensor | None = None
    load: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> tokens per expert

    def agreement(self) -> dict[str, float]:
        """Sums over this plan's forwards (reduce them over ranks, then divide by
        `moe/compared`): token x layer pairs whose top-k expert sets equal the recorded ones,
        single choices (of k) in the recorded set, pairs compared."""
        same_set, same_choice, compared = (
            (0.0, 0.0, 0.0) if self.counts is None else (self.counts.tolist())
        )
        return {"moe/same_set": same_set, "moe/same_choice": same_choice, "moe/compared": compared}


_PLAN: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("routing", default=None)


@contextlib.contextmanager
def plan(current: Plan):
    """Within this block the routers of every MoE layer follow `current`."""
    token = _PLAN.set(current)
    try:
        yield current
    finally:
        _PLAN.reset(token)


class RouterHook:
    """megatron-core's `router_replay` slot: top-k selection that follows the current Plan."""

    def __init__(self, router):
        self.router = router
        self.layer_number = None  # megatron-core sets it (Router.set_layer_number)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default=None):
        probs, chosen = default(scores, topk, num_groups=num_groups, group_topk=group_topk)
        current = _PLAN.get()
        if current is None:
            return probs, chosen
        layer = self.router.layer_number - 1
        if current.targets is not None:
            target = current.targets[:, layer].to(chosen.device, torch.long)
            known = target[:, 0] >= 0
            _compare(current, chosen, target, known)
            if current.replay:
                chosen = torch.where(known[:, None], target, chosen)
                probs = scores.gather(1, chosen)
        if current.count_load:
            counts = torch.zeros(scores.shape[1], device=chosen.device)
            counts.scatter_add_(
                0, chosen.flatten(), torch.ones_like(chosen.flatten(), dtype=counts.dtype)
            )
            current.load[layer] = current.load.get(layer, 0) + counts
        return probs, chosen


def _compare(current: Plan, chosen, target, known) -> None:
    with torch.no_grad():
        hits = (chosen[:, :, None] == target[:, None, :]).any(-1) & known[:, None]  # [T, k]
        sums = torch.stack([hits.all(-1).sum(), hits.sum() / chosen.shape[1], known.sum()]).double()
        current.counts = sums if current.counts is None else current.counts + sums


def is_moe(core) -> bool:
    """Whether a built megatron model has routed experts."""
    from rlflow.model.forward import language_model

    return bool(getattr(language_model(core).config, "num_moe_experts", None))


def packed_order(routing: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[rows, L, layers, k] -> [real tokens, layers, k] in packed order (rows end to end)."""
    return routing[attention_mask.bool().to(routing.device)]


def padded_order(routing: torch.Tensor) -> torch.Tensor:
    """[rows, L, layers, k] -> [L * rows, layers, k]: the order of a padded [L, rows] batch."""
    return routing.transpose(0, 1).reshape(-1, *routing.shape[2:])


def load_spread(load: dict[int, torch.Tensor]) -> dict[str, float]:
    """Per layer: the busiest expert's tokens over the mean (1 = perfectly balanced)."""
    out = {}
    for layer, counts in sorted(load.items()):
        counts = counts.cpu()
        out[f"moe/load_spread_layer{layer}"] = float(counts.max() / counts.mean().clamp(min=1))
    if out:
        out["moe/load_spread"] = sum(out.values()) / len(out)
    return out


@dataclass
class Stats:
    """A step's routing statistics of one policy: agreement and load (logprob passes), and the
    number of training forwards (for the load-balancing loss megatron-core accumulates)."""

    counts: torch.Tensor | None = None
    load: dict[int, torch.Tensor] = field(default_factory=dict)
    train_forwards: int = 0

    def add(self, done: Plan, counted: bool) -> None:
        if torch.is_grad_enabled():
            self.train_forwards += 1
        if not counted:
            return
        if done.counts is not None:
            self.counts = done.counts if self.counts is None else self.counts + done.counts
        for layer, counts in done.load.items():
            self.load[layer] = self.load.get(layer, 0) + counts


@contextlib.contextmanager
def replayed(policy, batch, packed: bool, *, replay: bool, count: bool | None = None):
    """One forward of `batch` under router replay (MoE models; a no-op for dense ones): the
    targets are the batch's recorded experts in the forward's token order, followed with `replay`
    (loss.router_replay) and compared either way. A counted forward
    compares and counts, and adds to the policy's step statistics: by default the logprob
    passes (no grad); `count=True` for an update forward that stands in for the old-logprob
    pass (one mini-batch: rlflow/train/update.py), so each rollout is counted once a step."""
    if not is_moe(policy.core):
        yield None
        return
    targets = None
    if batch.routing is not None:
        recorded = batch.routing.to(batch.attention_mask.device)
        targets = packed_order(recorded, batch.attention_mask) if packed else padded_order(recorded)
    count = not torch.is_grad_enabled() if count is None else count
    current = Plan(targets, replay=replay and targets is not None, count_load=count)
    with plan(current):
        yield current
    if policy.routing_stats is None:
        policy.routing_stats = Stats()
    policy.routing_stats.add(current, counted=count)


@contextlib.contextmanager
def uncounted(policy):
    """Forwards inside add nothing to the step's routing statistics (expert-parallel fillers:
    rlflow/train/update.py `lockstep_parts`)."""
    kept, policy.routing_stats = policy.routing_stats, Stats()
    try:
        yield
    finally:
        policy.routing_stats = kept


def mute_aux_loss(policy) -> None:
    """No load-balancing-loss gradient from the next backwards (fillers) until the next
    `set_aux_loss_scale`."""
    if is_moe(policy.core):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.0))


def set_aux_loss_scale(policy, micro_batches: int) -> None:
    """The load-balancing loss's gradient share per micro-batch of one optimizer step: 1/n, so
    the step trains on its mean (megatron-core's own schedule sets the same scale)."""
    if is_moe(policy.core):
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / max(micro_batches, 1)))


def step_metrics(policy, group=None) -> dict[str, float]:
    """The step's routing metrics (summed over data-parallel ranks), then reset:

    * moe/routing_agreement: share of token x layer pairs whose experts in the trainer's first
      pass over the rollouts (the old-logprob pass, or with one mini-batch the update's
      forward; the router's own choice, before any replay) equal generation's;
    * moe/expert_agreement: share of single expert choices that agree;
    * moe/load_spread (and per layer): busiest expert's tokens over the mean;
    * moe/aux_loss: megatron-core's load-balancing loss (before its coefficient), mean over
      layers and training forwards (when the loss is on)."""
    from rlflow import parallel

    stats, policy.routing_stats = policy.routing_stats, None
    if not is_moe(policy.core):
        return {}
    stats = stats or Stats()
    layers = sorted(stats.load)
    agreement = Plan(None, False, False, counts=stats.counts).agreement()
    aux = _pop_aux_loss()
    sums = [*agreement.values(), aux, float(stats.train_forwards)]
    loads = [stats.load[layer].cpu() for layer in layers]
    flat = sums + [float(x) for counts in loads for x in counts]
    flat = parallel.all_reduce_sum(flat, group)
    same_set, same_choice, compared, aux, forwards = flat[:5]
    out = {}
    if compared:
        out["moe/routing_agreement"] = same_set / compared
        out["moe/expert_agreement"] = same_choice / compared
    if forwards:
        out["moe/aux_loss"] = aux / forwards
    if loads:
        experts = loads[0].numel()
        reduced = torch.tensor(flat[5:]).view(len(layers), experts)
        out.update(load_spread(dict(zip(layers, reduced))))
    return out


def _pop_aux_loss() -> float:
    """Sum over layers of megatron-core's recorded load-balancing loss / number of layers."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    entry = tracker.metrics.get("load_balancing_loss")
    if entry is None:
        return 0.0
    value = float(entry.values.sum()) / max(entry.values.numel(), 1)
    tracker.clear()
    return value
