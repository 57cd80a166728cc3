"""What the trainer reads off a policy's logits: the targets' log-probabilities and the entropy.

Under tensor parallelism the output layer is megatron-core's ColumnParallelLinear with
gather_output=False: each rank holds the logits of its own slice of the vocabulary. Neither
number needs the whole vocabulary on one rank (megatron-core's `vocab_parallel_cross_entropy`
shows the method): with m the row's maximum over all ranks,

    log Z   = m + log sum_ranks sum_v exp(z_v - m)
    logp(y) = z_y - log Z                         (z_y lives on the rank that holds y)
    H       = log Z - sum_ranks sum_v p_v z_v     (the entropy)

so one MAX all-reduce of [N] and one SUM all-reduce of [3, N] over the tensor-parallel group
give both, and the backward pass needs no communication at all: the gradient of a rank's
logits involves only its own slice and the (already reduced) log Z and H. With no group (one
rank) the same code runs without the collectives, so TP=1 and TP>1 share every line of math.

Used by the packed forward (rlflow/model/packed_forward.py) and the padded one
(rlflow/train/update.py), so it lives at the model layer, below both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy (nats) of softmax(logits) per position, (B, T), in fp32, from full-vocabulary
    logits (the reference the vocab-parallel path is tested against).

    -sum p log p via log_softmax; entries with p = 0 (e.g. -inf logits) contribute exactly 0
    and no NaN gradient.
    """
    logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    p_BTV = logp_BTV.exp()
    return -(p_BTV * logp_BTV.masked_fill(p_BTV == 0, 0.0)).sum(-1)


def vocab_parallel_logprobs(
    logits: Tensor, targets: Tensor, *, with_entropy: bool, group
) -> tuple[Tensor, Tensor | None]:
    """fp32 log softmax(logits)[target] and (if asked) the entropy, both shaped like `targets`.

    logits [..., V/tp]: this rank's slice of the vocabulary (rank r of `group` holds entries
    r*V/tp .. (r+1)*V/tp - 1; the whole vocabulary when `group` is None). Differentiable in
    both outputs. Only the logits (their own dtype) and two numbers per row are kept for the
    backward pass: no fp32 copy of a [N, V] tensor outlives the call.
    """
    shape = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    logprobs, entropy = _VocabParallel.apply(flat, targets.reshape(-1), with_entropy, group)
    return logprobs.view(shape), entropy.view(shape) if with_entropy else None


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, with_entropy: bool, group):
        ctx.set_materialize_grads(False)  # an output the loss does not use has no gradient
        z = logits.float()  # [N, V/tp]
        width = z.shape[-1]
        start = 0 if group is None else dist.get_rank(group) * width
        m = z.max(-1).values
        if _group_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        m = torch.where(torch.isfinite(m), m, 0.0)  # a row of -inf stays -inf, not NaN
        e = (z - m[:, None]).exp_()
        local = targets.long() - start
        mine = (local >= 0) & (local < width)
        picked = z.gather(1, local.clamp(0, width - 1)[:, None])[:, 0]
        sums = [e.sum(-1), torch.where(mine, picked, 0.0)]
        if with_entropy:
            # sum e * z with 0 where e = 0 (z = -inf there: 0 * -inf would be NaN)
            zero = e == 0
            sums.append(e.mul_(z).masked_fill_(zero, 0.0).sum(-1))
        del e
        sums = torch.stack(sums)
        if _group_size(group) > 1:
            dist.all_reduce(sums, group=group)
        lse = m + sums[0].log()
        logprobs = sums[1] - lse
        entropy = lse - sums[2] / sums[0] if with_entropy else lse.new_empty(0)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.start = start
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, grad_entropy: Tensor):
        logits, targets, lse, entropy = ctx.saved_tensors
        # this slice of softmax(logits), in place in one fp32 copy of the logits
        out = logits.to(torch.float32, copy=True).sub_(lse[:, None]).exp_()
        entropy_term = None
        if grad_entropy is not None and entropy.numel():
            # dH / dz_v = -p_v (log p_v + H) = -p_v (z_v - log Z + H); 0 where p_v = 0
            term = logits.float() + (entropy - lse)[:, None]
            entropy_term = term.mul_(out).masked_fill_(out == 0, 0.0).mul_(grad_entropy[:, None])
        # d logp(y) / dz = onehot(y) - p
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        out.mul_(-grad_logprobs[:, None])
        if entropy_term is not None:
            out.sub_(entropy_term)
        width = out.shape[-1]
        local = targets.long() - ctx.start
        rows = ((local >= 0) & (local < width)).nonzero()[:, 0]
        out.index_put_((rows, local[rows]), grad_logprobs[rows], accumulate=True)
        return out.to(logits.dtype), None, None, None
