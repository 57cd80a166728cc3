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

from rlflow.model import sequence_parallel
from rlflow.model.families.qwen3vl import deepstack
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
    grids = Media.concat([m.layout() for m in media], input_ids.device)
    positions = of_core(core).positions(core, input_ids, attention_mask, grids, prompt_mask)
    positions = positions[..., valid].unsqueeze(-2)  # [(3,) 1, T]: each row's own positions
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    target_index = (starts[:, None] + columns[None, :-1])[target_mask]
    ids, prompts = input_ids[valid][None], prompt_mask[valid][None]
    extra = sequence_parallel.pad_length(core, ids.shape[1])
    if extra:  # a dummy row of token 0, no targets: the sequence splits evenly over TP ranks
        lengths = [*lengths, extra]
        ids, prompts = sequence_parallel.pad_columns(core, ids, prompts)
        filler = torch.arange(extra, device=positions.device, dtype=positions.dtype)
        positions = torch.cat([positions, filler.expand(*positions.shape[:-1], extra)], -1)
    return PackedRows(
        input_ids=ids,
        prompt_mask=prompts,
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
    context = (rows.target_index, rows.targets, with_entropy, core)
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
    from rlflow import parallel
    from rlflow.model.logits import vocab_parallel_logprobs

    index, targets, with_entropy, core = context
    split = sequence_parallel.enabled(core)
    hidden = sequence_parallel.gather(core, hidden_states).index_select(0, index)  # [K, 1, H]
    vocab = output_layer.output_size_per_partition
    size = max(1, CHUNK_ELEMENTS // vocab)
    group = parallel.tensor_parallel_group()
    logprobs, entropies = [], []
    for start in range(0, max(hidden.shape[0], 1), size):
        logits = _output_logits(output_layer, hidden[start : start + size], output_weight, split)
        logits = scale_logits(logits)[:, 0]  # [C, V/tp]
        lp, entropy = vocab_parallel_logprobs(
            logits, targets[start : start + size], with_entropy=with_entropy, group=group
        )
        logprobs.append(lp)
        if with_entropy:
            entropies.append(entropy.detach())
    return torch.cat(logprobs), torch.cat(entropies) if with_entropy else None


def _output_logits(output_layer, hidden, weight, sequence_parallel_on: bool) -> torch.Tensor:
    """This rank's vocabulary slice of the logits at `hidden` [C, 1, H] (whole positions).

    Under sequence parallelism the output layer would all-gather its input over the sequence
    again; the hidden states here are already whole, so its matmul runs without that gather
    (the input copy sums the gradient over the tensor-parallel ranks, as the layer would).
    """
    if not sequence_parallel_on:
        return output_layer(hidden, weight=weight)[0]
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    weight = output_layer.weight if weight is None else weight
    return torch.nn.functional.linear(copy_to_tensor_model_parallel_region(hidden), weight)
