"""Forward passes of the trainer: logprob recomputation and the optimizer updates.

Data parallelism: each rank holds a shard of the step's rollouts. Losses are normalised by the
*global* token (or sequence) count of the mini-batch, so the gradient we want is the SUM over
ranks and micro-batches of each piece's gradient. megatron-core's DDP averages over data-parallel
ranks instead, so each micro-batch loss is scaled by the data-parallel size before backward
(`_backward`): one place, one factor.

Micro-batches: `micro_batch_size` rollouts each, or (`max_tokens_per_micro_batch` > 0) as many
consecutive rollouts as fit the token budget. With `sequence_packing` each micro-batch runs as
one packed sequence of its real tokens (rlflow.model.packed_forward) and only the generated
targets' logprobs are computed; either way the results land in the padded [n, L-1] layout, so
the loss and its normalisation never see the difference (positions outside `target_mask` hold 0
when packed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlflow import parallel
from rlflow.errors import Diagnostic, RlflowError
from rlflow.model.build import Policy
from rlflow.model.forward import policy_logits
from rlflow.model.logits import vocab_parallel_logprobs
from rlflow.model.moe import routing
from rlflow.recipe.schema import LossConfig, OptimizerConfig
from rlflow.train import grpo
from rlflow.train.rollouts import TrainBatch

if TYPE_CHECKING:  # megatron's optimizer module loads only when an optimizer is created
    from megatron.core.optimizer import MegatronOptimizer


@dataclass
class Optimizer:
    """megatron-core optimizer over a trainable policy's chunks."""

    policy: Policy
    inner: MegatronOptimizer

    @classmethod
    def from_config(
        cls, policy: Policy, cfg: OptimizerConfig, *, lr: float | None = None
    ) -> Optimizer:
        """megatron-core Adam over the policy's chunks; `lr` overrides cfg.lr (the warm start).

        The one place recipe keys (`optimizer.*`) become megatron's OptimizerConfig.
        """
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        if policy.dtype != torch.float32 and policy.device.type != "cuda":
            raise RlflowError(
                Diagnostic(
                    "train.dtype-device",
                    f"`model.dtype` {str(policy.dtype).removeprefix('torch.')} trains on GPUs "
                    f"only: megatron-core's mixed-precision optimizer keeps CUDA tensors, and "
                    f"this rank runs on the {policy.device.type}",
                    help="set model.dtype=float32 to train on the CPU",
                )
            )
        lr = cfg.lr if lr is None else lr
        config = MegatronOptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.max_grad_norm,
            bf16=policy.dtype == torch.bfloat16,
            params_dtype=policy.dtype,
            use_distributed_optimizer=False,
        )
        return cls(policy, get_megatron_optimizer(config, policy.chunks))

    def reload_weights(self) -> None:
        """The policy's weights changed outside this optimizer (a warm start): bf16 keeps fp32
        main copies of them, which must be refreshed before the next step."""
        self.inner.reload_model_params()

    def zero_grad(self) -> None:
        for chunk in self.policy.chunks:
            chunk.zero_grad_buffer()
        self.inner.zero_grad()

    def step(self) -> float:
        """Reduce grads over data-parallel ranks, clip, update; returns the grad norm."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(self.policy.chunks)
        ok, grad_norm, _ = self.inner.step()
        if not ok:
            raise FloatingPointError("optimizer step skipped: non-finite gradients")
        return float(grad_norm or 0.0)


@dataclass(frozen=True)
class Batching:
    """How a batch is cut into forward passes: the recipe's optimizer.micro_batch_size,
    max_tokens_per_micro_batch and sequence_packing, as one value."""

    micro_batch_size: int  # rows per pass (when max_tokens is 0)
    max_tokens: int  # > 0: as many rows as fit this token budget instead
    packed: bool  # each pass runs as one packed sequence of real tokens

    @classmethod
    def from_config(cls, cfg: OptimizerConfig) -> Batching:
        return cls(cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, cfg.sequence_packing)

    def split(self, lengths: list[int]) -> list[list[int]]:
        """Row indices of each pass (`micro_batches`)."""
        return micro_batches(
            lengths, self.micro_batch_size, max_tokens=self.max_tokens, packed=self.packed
        )


def policy_token_logprobs(
    policy: Policy,
    batch: TrainBatch,
    with_entropy: bool = False,
    *,
    packed: bool,
    router_replay: bool,
    count_routing: bool | None = None,
):
    """Per-target logprobs [N, L-1] (and entropy) of the batch under the policy's weights.

    packed: one packed sequence, logprobs at target positions only (0 elsewhere); otherwise
    the padded reference path (every position). router_replay (loss.router_replay): MoE
    tokens go to the experts they had in generation. count_routing: MoE routing statistics
    from this forward (`routing.replayed`; default: without gradients only).
    """
    info = parallel.info()
    batch = batch.to(info.device)
    # MoE: router replay (a no-op when dense)
    with routing.replayed(policy, batch, packed, replay=router_replay, count=count_routing):
        if packed:
            return _packed_token_logprobs(policy, batch, with_entropy)
        return _padded_token_logprobs(policy, batch, with_entropy)


def _padded_token_logprobs(policy: Policy, batch: TrainBatch, with_entropy: bool):
    info = parallel.info()
    logits = policy_logits(
        policy.core,
        batch.input_ids,
        batch.attention_mask,
        batch.stacked_media(info.device),
        batch.prompt_mask,
    )[:, :-1]
    return vocab_parallel_logprobs(
        logits, batch.targets, with_entropy=with_entropy, group=parallel.tensor_parallel_group()
    )


def _packed_token_logprobs(policy: Policy, batch: TrainBatch, with_entropy: bool):
    from rlflow.model.packed_forward import pack_rows, target_logprobs

    core = policy.core
    rows = pack_rows(
        core,
        batch.input_ids,
        batch.attention_mask,
        batch.prompt_mask,
        batch.target_mask,
        batch.media,
    )
    features = (None, None)
    if policy.is_multimodal:
        features = policy.vision_cache.features(core, batch.media)
    logprobs, entropy = target_logprobs(core, rows, features, with_entropy)
    mask = batch.target_mask

    def unpack(values):  # [K] in row-major order of the mask -> [n, L-1], 0 elsewhere
        return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(
            mask, values
        )

    return unpack(logprobs), None if entropy is None else unpack(entropy)


def lockstep_parts(policy: Policy, parts: list[list[int]]) -> list[tuple[list[int], bool]]:
    """(rows, filler) for each forward of this rank. Under expert parallelism every forward's
    token all-to-all spans data-parallel ranks, so all of them must run as many forwards and
    backwards as the rank with the most micro-batches (token budgets cut ranks' rows into
    different counts; a missing one hung every peer). A rank with fewer repeats its last part
    as a filler: its logprobs are dropped, its loss is scaled by zero and its load-balancing
    loss muted. Dense models and EP = 1 run their own parts only."""
    real = [(part, False) for part in parts]
    if not parts or not routing.is_moe(policy.core) or parallel.expert_parallel_size() == 1:
        return real
    most = int(parallel.all_reduce_max(float(len(parts)), parallel.data_parallel_group()))
    return real + [(parts[-1], True)] * (most - len(parts))


def micro_batches(
    lengths: list[int], micro_batch_size: int, *, max_tokens: int, packed: bool
) -> list[list[int]]:
    """Consecutive groups of row indices, one per forward pass.

    max_tokens = 0: micro_batch_size rows each. Otherwise as many rows as fit the budget, counted
    as the forward computes them: real tokens when packed, rows x longest row when padded. A row
    longer than the budget goes alone.
    """
    if max_tokens <= 0:
        return [
            list(range(i, min(i + micro_batch_size, len(lengths))))
            for i in range(0, len(lengths), micro_batch_size)
        ]
    groups: list[list[int]] = [[]]
    total = longest = 0
    for i, n in enumerate(lengths):
        total, longest = total + n, max(longest, n)
        cost = total if packed else (len(groups[-1]) + 1) * longest
        if groups[-1] and cost > max_tokens:
            groups.append([])
            total = longest = n
        groups[-1].append(i)
    return [g for g in groups if g]


@torch.no_grad()
def rollout_logprobs(
    policy: Policy,
    batch: TrainBatch,
    batching: Batching,
    *,
    with_entropy: bool,
    router_replay: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of every rollout in micro-batches, padded back to the batch width (no grad);
    router_replay: loss.router_replay (MoE)."""
    width = batch.input_ids.shape[1] - 1
    logprobs = torch.zeros(len(batch), width)
    entropy = torch.zeros(len(batch), width) if with_entropy else None
    was_training = policy.core.training
    policy.core.eval()
    try:
        for pick, filler in lockstep_parts(policy, batching.split(batch.lengths)):
            micro = batch.rows(pick)
            if filler:  # joins the peers' collectives; its results are not this rank's
                with routing.uncounted(policy):
                    policy_token_logprobs(
                        policy, micro, packed=batching.packed, router_replay=router_replay
                    )
                continue
            lp, ent = policy_token_logprobs(
                policy,
                micro,
                with_entropy=with_entropy,
                packed=batching.packed,
                router_replay=router_replay,
            )
            logprobs[pick, : lp.shape[1]] = lp.cpu()
            if entropy is not None:
                entropy[pick, : ent.shape[1]] = ent.cpu()
    finally:
        policy.core.train(was_training)
    return logprobs, entropy


def global_counts(mask: torch.Tensor) -> tuple[float, float]:
    """(valid tokens, valid sequences) of a mini-batch summed over data-parallel ranks."""
    tokens, seqs = grpo.valid_counts(mask)
    return tuple(
        parallel.all_reduce_sum([float(tokens), float(seqs)], parallel.data_parallel_group())
    )


def update_gives_old_logprobs(num_minibatches: int) -> bool:
    """Whether the update's own forward pass can stand in for the old-logprob pass.

    The old logprobs are the current weights' (in async mode too: the generator's own are
    `gen_logprobs`, for importance sampling). With one optimizer update per step, every
    micro-batch's forward runs on the weights the step started with, so the old policy of the
    PPO ratio is the policy being differentiated: old = logprobs.detach(), a ratio of exactly
    1, what a separate recomputation gives up to kernel nondeterminism (TRL does the same with
    one update per generation). That saves one forward pass over every rollout. With several
    mini-batches the policy moves between them, so the old logprobs are computed first.
    """
    return num_minibatches == 1


@dataclass
class Update:
    """What `grpo_update` returns: its metrics, and, when it computed them itself
    (`old_logprobs=None`), the rollouts' logprobs [n, L-1] before the update and their entropy
    (CPU, 0 outside the targets when packed), for the step's metrics."""

    metrics: dict[str, float]
    old_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def grpo_update(
    policy: Policy,
    optimizer: Optimizer,
    batch: TrainBatch,
    *,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    loss_cfg: LossConfig,
    batching: Batching,
    num_minibatches: int,
) -> Update:
    """num_minibatches optimizer updates over the batch; metrics averaged over updates.

    old_logprobs None: the update's forward gives them (`update_gives_old_logprobs`); they are
    returned with the entropy.
    """
    if old_logprobs is None and not update_gives_old_logprobs(num_minibatches):
        raise ValueError(f"{num_minibatches} mini-batches need the old logprobs computed first")
    record = None
    if old_logprobs is None:
        width = batch.input_ids.shape[1] - 1
        record = (torch.zeros(len(batch), width), torch.zeros(len(batch), width))
    totals: dict[str, float] = {}
    size = len(batch) // num_minibatches
    terms = clip_terms(loss_cfg)
    for first in range(0, size * num_minibatches, size):
        rows = list(range(first, first + size))
        num_tokens, num_seqs = global_counts(batch.target_mask[rows])
        optimizer.zero_grad()
        sums: dict[str, float] = {}
        lengths = batch.lengths
        parts = batching.split([lengths[i] for i in rows])
        routing.set_aux_loss_scale(policy, len(parts))  # MoE: the load-balancing loss's share
        for part, filler in lockstep_parts(policy, parts):
            pick = [rows[i] for i in part]
            if filler:
                routing.mute_aux_loss(policy)
            metrics = _grpo_micro_step(
                policy,
                batch.rows(pick),
                old_lp=None if old_logprobs is None else old_logprobs[pick],
                record=None if record is None or filler else (record, pick),
                ref_lp=None if ref_logprobs is None else ref_logprobs[pick],
                loss_cfg=loss_cfg,
                terms=terms,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                packed=batching.packed,
                weight=0.0 if filler else 1.0,
            )
            if filler:
                continue
            for key, value in metrics.items():
                _add_metric(sums, key, value)
        maxima = {
            k: parallel.all_reduce_max(sums.pop(k), parallel.data_parallel_group())
            for k in list(sums)
            if k.endswith("_max")
        }
        sums = dict(
            zip(sums, parallel.all_reduce_sum(list(sums.values()), parallel.data_parallel_group()))
        )
        sums["grad_norm"] = optimizer.step()
        for key, value in sums.items():
            totals[key] = totals.get(key, 0.0) + value / num_minibatches
        for key, value in maxima.items():
            _add_metric(totals, key, value)
    if record is None:
        return Update(totals)
    return Update(totals, *record)


def clip_terms(loss_cfg: LossConfig) -> grpo.ClipTerms:
    """The loss's constants from the recipe's `loss` section (grpo.py stays schema-free)."""
    return grpo.ClipTerms(
        clip_low=loss_cfg.ratio_clip_low,
        clip_high=loss_cfg.ratio_clip_high,
        kl_weight=loss_cfg.kl_penalty,
        token_level=loss_cfg.token_level_loss,
        ratio_level=loss_cfg.ratio_level,
    )


def _grpo_micro_step(
    policy,
    micro: TrainBatch,
    *,
    old_lp: torch.Tensor | None,
    record: tuple[tuple[torch.Tensor, torch.Tensor], list[int]] | None,
    ref_lp: torch.Tensor | None,
    loss_cfg: LossConfig,
    terms: grpo.ClipTerms,
    num_tokens: float,
    num_seqs: float,
    packed: bool,
    weight: float,
) -> dict[str, float]:
    """One forward and backward of `micro`'s share of the loss, times `weight` (0: a filler).

    old_lp None: this forward's own logprobs, detached, are the old ones; `record` ((logprobs,
    entropy) of the whole batch, this micro-batch's rows) receives them and the entropy.
    """
    device = parallel.info().device
    width = micro.input_ids.shape[1] - 1
    logprobs, entropy = policy_token_logprobs(
        policy,
        micro,
        with_entropy=old_lp is None,
        packed=packed,
        router_replay=loss_cfg.router_replay,  # MoE: route as generation did
        count_routing=record is not None,  # the old-logprob pass's routing statistics
    )
    mask = micro.target_mask.to(device)
    if old_lp is None:
        old = logprobs.detach()
        if record is not None:
            (all_logprobs, all_entropy), pick = record
            all_logprobs[pick, : old.shape[1]] = old.cpu()
            all_entropy[pick, : entropy.shape[1]] = entropy.detach().cpu()
    else:
        old = old_lp[:, :width].to(device)
    kl = None
    if ref_lp is not None:
        kl = grpo.kl_estimate(logprobs, ref_lp[:, :width].to(device), loss_cfg.kl_type)
    is_weights, is_metrics = _importance_weights(loss_cfg, old, micro, mask, num_tokens)
    loss, metrics = grpo.clipped_pg_loss(
        logprobs_BT=logprobs,
        old_logprobs_BT=old,
        advantages_B=micro.advantages.to(device),
        mask_BT=mask,
        terms=terms,
        global_num_tokens=num_tokens,
        global_num_seqs=num_seqs,
        kl_BT=kl,
        is_weights_BT=is_weights,
    )
    _backward(loss * weight)
    return {key: float(value) for key, value in {**metrics, **is_metrics}.items()}


def _importance_weights(loss_cfg: LossConfig, old, micro: TrainBatch, mask, num_tokens):
    """TIS/MIS weights from the generator's vs the trainer's logprobs (None when off)."""
    cfg = loss_cfg.importance_sampling
    if cfg.mode not in ("tis", "mis"):  # off (auto is resolved by the caller: effective_loss)
        return None, {}
    gen = micro.gen_logprobs.to(mask.device)
    weights, clipped = grpo.importance_weights(old, gen, mask, cfg.mode, cfg.cap, cfg.mask_below)
    return weights, grpo.importance_metrics(weights, clipped, mask, num_tokens)


def _add_metric(sums: dict[str, float], key: str, value: float) -> None:
    """Micro-batch metrics are shares that add up; `*_max` metrics take the maximum."""
    if key.endswith("_max"):
        sums[key] = max(sums.get(key, value), value)
    else:
        sums[key] = sums.get(key, 0.0) + value


def sft_update(
    policy: Policy, optimizer: Optimizer, batch: TrainBatch, batching: Batching
) -> float:
    """One supervised step: mean negative logprob of the target tokens; returns the loss."""
    num_tokens, _ = global_counts(batch.target_mask)
    optimizer.zero_grad()
    total = 0.0
    device = parallel.info().device
    parts = batching.split(batch.lengths)
    routing.set_aux_loss_scale(policy, len(parts))
    for pick, filler in lockstep_parts(policy, parts):
        micro = batch.rows(pick)
        if filler:
            routing.mute_aux_loss(policy)
        logprobs, _ = policy_token_logprobs(
            policy,
            micro,
            packed=batching.packed,
            router_replay=False,  # no generation to follow
        )
        mask = micro.target_mask.to(device)
        loss = -(logprobs * mask).sum() / num_tokens
        _backward(loss * (0.0 if filler else 1.0))
        total += 0.0 if filler else float(loss.detach())
    optimizer.step()
    return parallel.all_reduce_sum([total], parallel.data_parallel_group())[0]


def _backward(loss: torch.Tensor) -> None:
    # The loss is this rank's share of a global mean; DDP divides gradients by the data-parallel
    # size when it reduces them, so undo that to get the plain sum of shares.
    (loss * parallel.info().dp_size).backward()
