"""The trainer's packed forward: a micro-batch as one sequence, logprobs only where needed.

A right-padded micro-batch [n, L] becomes one row [1, T] of its real tokens (T = sum of the row
lengths): positions restart in every row (the family's positions of the padded rows, then only
the real tokens kept), vision features sit at the prompts' pad tokens (DeepStack's part added
after the first layers), and attention stays within each row (`packed_attention.packing`). No
compute is spent on padding.

The output layer (hidden x vocabulary, the largest matmul of a small model) then runs only at
the positions whose next token is a generated token, in chunks, through megatron-core's
`output_processor` hook; the target logprobs (and, without gradients, the entropy) are computed
in fp32 one chunk at a time, so memory stays bounded by the chunk, not by T x vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlflow.model import deepstack
from rlflow.model.family import of_core
from rlflow.model.forward import language_model, media_slots, run_language_model
from rlflow.model.media import Media
from rlflow.model.packed_attention import Packing, packing

# fp32 logits per chunk of the output layer: 2**27 entries = 512 MiB (~880 targets at a 152k vocab)
CHUNK_ELEMENTS = 2**27


@dataclass
class PackedRows:
    """A right-padded micro-batch laid end to end (only real tokens)."""

    input_ids: torch.Tensor  # [1, T]
    prompt_mask: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T] (1-D RoPE) or [3, 1, T] (mrope families)
    lengths: list[int]  # real tokens per row
    target_index: torch.Tensor  # [K] packed positions whose next token is a target
    targets: torch.Tensor  # [K] the target tokens, in row-major order of target_mask


def pack_rows(
    core,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_mask: torch.Tensor,
    target_mask: torch.Tensor,
    media: list[Media],
) -> PackedRows:
    """Pack right-padded rows [n, L]; target_mask [n, L-1] marks which logprobs are wanted."""
    valid = attention_mask.bool()
    lengths_t = valid.sum(1)
    columns = torch.arange(valid.shape[1], device=valid.device)
    if not torch.equal(valid, columns[None] < lengths_t[:, None]):
        raise ValueError("sequence packing needs right-padded rows (padding after the tokens)")
    lengths = lengths_t.tolist()
    # Positions need the grids only: no pixels are concatenated or moved here.
    grids = Media.concat(
        [Media(None, m.image_grid_thw, None, m.video_grid_thw, m.second_per_grid_ts) for m in media]
    ).to(input_ids.device)
    positions = of_core(core).positions(core, input_ids, attention_mask, grids, prompt_mask)
    positions = positions[..., valid].unsqueeze(-2)  # [(3,) 1, T]: each row's own positions
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    target_index = (starts[:, None] + columns[None, :-1])[target_mask]
    return PackedRows(
        input_ids=input_ids[valid][None],
        prompt_mask=prompt_mask[valid][None],
        positions=positions,
        lengths=lengths,
        target_index=target_index,
        targets=input_ids[:, 1:][target_mask],
    )


def target_logprobs(
    core,
    rows: PackedRows,
    features: tuple[torch.Tensor | None, torch.Tensor | None],
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logprobs [K] of `rows.targets` (and entropies [K] if asked, without gradients).

    features: (image, video) vision-tower embeddings of the rows, in row order.
    """
    pack = Packing.of(rows.lengths, rows.input_ids.device)
    context = (rows.target_index, rows.targets, with_entropy)
    inputs = None
    if core.pre_process:
        embeddings = language_model(core).embedding(input_ids=rows.input_ids, position_ids=None)
        inputs = place_features(core, embeddings, rows.input_ids, rows.prompt_mask, features)
    with packing(pack):
        return run_language_model(
            core,
            rows.positions,
            None,
            inputs,
            output_processor=_target_logprobs,
            output_processor_context=context,
        )


def place_features(core, embeddings, input_ids, prompt_mask, features) -> deepstack.Embedded:
    """Packed embeddings [T, 1, H] with the vision features written at their pad tokens."""
    tokens = of_core(core).media_tokens(core.config)
    slots = [media_slots(input_ids, prompt_mask, t) for t in (tokens.image, tokens.video)]
    return deepstack.place(embeddings, slots, features)


def _target_logprobs(
    *, hidden_states, output_layer, output_weight, context, scale_logits, **_
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """megatron-core output_processor: the output layer at the target positions only."""
    index, targets, with_entropy = context
    hidden = hidden_states.index_select(0, index)  # [K, 1, H]
    vocab = output_layer.output_size_per_partition
    size = max(1, CHUNK_ELEMENTS // vocab)
    logprobs, entropies = [], []
    for start in range(0, max(hidden.shape[0], 1), size):
        logits, _ = output_layer(hidden[start : start + size], weight=output_weight)
        logits = scale_logits(logits)[:, 0]  # [C, V/tp]
        chunk_targets = targets[start : start + size]
        logprobs.append(_chunk_logprobs(logits, chunk_targets))
        if with_entropy:
            entropies.append(_chunk_entropy(logits))
    return torch.cat(logprobs), torch.cat(entropies) if with_entropy else None


def _chunk_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from rlflow import parallel

    if parallel.info().tp_size == 1:
        return TargetLogprob.apply(logits, targets)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # A copy: megatron's vocab-parallel cross entropy works in place on its input (and .float()
    # of fp32 logits would be the logits themselves, which the entropy still needs).
    fp32 = logits.to(torch.float32, copy=True)
    return -vocab_parallel_cross_entropy(fp32[:, None], targets[:, None])[:, 0]


@torch.no_grad()
def _chunk_entropy(logits: torch.Tensor) -> torch.Tensor:
    from rlflow import parallel
    from rlflow.model.logits import entropy_from_logits

    if parallel.info().tp_size > 1:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)
    return entropy_from_logits(logits[None])[0]


class TargetLogprob(torch.autograd.Function):
    """log softmax(logits)[target] in fp32, keeping only the logits (their own dtype) and the
    log-normaliser for the backward pass: no fp32 copy of a [C, V] tensor outlives the chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        full = logits.float()
        lse = torch.logsumexp(full, dim=-1)
        picked = full.gather(1, targets[:, None].long())[:, 0]
        ctx.save_for_backward(logits, targets, lse)
        return picked - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        # d/dlogits (logit[y] - lse) = onehot(y) - softmax
        out = logits.to(torch.float32, copy=True).sub_(lse[:, None]).exp_().neg_()
        out.scatter_add_(1, targets[:, None].long(), torch.ones_like(out[:, :1]))
        return out.mul_(grad[:, None]).to(logits.dtype), None
