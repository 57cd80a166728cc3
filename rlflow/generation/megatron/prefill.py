"""A generation pass's packed prefill inputs: the unique prompts end to end, their embeddings
(vision features scattered in), rotary positions, and where their keys go in the cache.

Used by rlflow/generation/megatron/engine.py (which explains the engine)."""

from __future__ import annotations

import torch

from rlflow.generation.megatron.kv_cache import KVCache
from rlflow.model.families.qwen3vl.deepstack import Embedded
from rlflow.model.family import of_core
from rlflow.model.forward import embed
from rlflow.model.media import Media
from rlflow.model.packed_attention import Packing


def packed_prompts(core, prompts, ids, tokens: int, *, decoder, policy, pad_token_id, device):
    """(pack, attend, inputs, cos, sin, next positions) of this rank's prompts, packed.

    Expert parallelism: every EP rank of a pass runs `tokens` prefill tokens (the group's
    most), so their all-to-alls line up: `attend` adds one padding sequence where this rank
    has fewer (or none at all)."""
    if prompts:
        pack = Packing.of([len(i) for i in ids], device)
        inputs, cos, sin, next_pos = _prefill_inputs(
            core, prompts, ids, pack, decoder=decoder, policy=policy, pad_token_id=pad_token_id,
            device=device,
        )  # fmt: skip
    else:  # an expert-parallel rank with nothing left to generate joins its peers
        pack, next_pos = Packing.of([0], device), torch.zeros(0, dtype=torch.long)
        hidden, cos, sin = _no_tokens(decoder, policy.dtype, device)
        inputs = Embedded(hidden)
    attend = pack
    if tokens > pack.total:
        hidden, cos, sin = _pad_tokens(inputs.hidden, cos, sin, tokens - pack.total)
        inputs = Embedded(hidden, inputs.deepstack)  # (features address real positions)
        attend = Packing.of([*[len(i) for i in ids], tokens - pack.total], device)
    return pack, attend, inputs, cos, sin, next_pos


def prefill_slots(pack: Packing, row_slot: torch.Tensor, cache: KVCache, base: int = 0):
    """(dest, src): row r's token j (its cache slot, through the block table of batch position
    base + r) <- packed token start(prompt of row r) + j."""
    lengths = torch.tensor(pack.lengths, device=row_slot.device)[row_slot]  # per row
    starts = pack.cu_seqlens[:-1].long()[row_slot]
    row_of_token = torch.repeat_interleave(
        torch.arange(len(row_slot), device=row_slot.device), lengths
    )
    first = torch.cumsum(lengths, 0) - lengths  # each row's first entry in the flat list
    offset = torch.arange(int(lengths.sum()), device=row_slot.device) - first[row_of_token]
    return cache.slots(row_of_token + base, offset), starts[row_of_token] + offset


def _prefill_inputs(core, prompts, ids, pack: Packing, *, decoder, policy, pad_token_id, device):
    """Packed inputs (embeddings [T, H], DeepStack features), cos/sin [T, 1, D] and each
    prompt's next text position.

    A right-padded batch of the unique prompts gives the family's positions and the vision
    features per prompt; then only the real tokens are kept (the LM never sees padding)."""
    dtype = policy.dtype
    width = pack.max_len
    padded = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
    valid = torch.zeros((len(ids), width), dtype=torch.bool)
    for i, row in enumerate(ids):
        padded[i, : len(row)] = torch.tensor(row)
        valid[i, : len(row)] = True
    media_rows = [p.media for p in prompts]
    media = Media.concat([m.layout() for m in media_rows])  # the tower alone reads pixels
    # positions from the host copies (mrope's index loops run on the host either way)
    positions = of_core(core).positions(core, padded, valid, media).to(device)  # [(3,) P, W]
    padded, valid = padded.to(device), valid.to(device)
    features = None
    if media.num_images or media.num_videos:
        features = policy.vision_cache.features(core, media_rows)
    inputs = embed(core, padded, media, features=features)  # [W, P, H]
    inputs.hidden = inputs.hidden.transpose(0, 1)[valid]  # [T, H]
    if inputs.deepstack is not None:
        inputs.deepstack = inputs.deepstack.packed(valid)
    cos, sin = decoder.rotary(positions[..., valid], dtype)
    last = positions.masked_fill(~valid, 0).reshape(-1, *valid.shape).amax(dim=(0, 2))
    return inputs, cos, sin, last + 1


def _no_tokens(decoder, dtype, device):
    """Empty packed inputs: hidden [0, H], cos/sin [0, 1, D]."""
    hidden = torch.zeros(0, decoder.final_norm.shape[0], dtype=dtype, device=device)
    cos = torch.zeros(0, 1, decoder.dims.head_dim, dtype=dtype, device=device)
    return hidden, cos, cos


def _pad_tokens(hidden, cos, sin, count: int):
    """`count` padding tokens after the packed prompts: zero states, no rotation."""
    return (
        torch.cat([hidden, hidden.new_zeros(count, hidden.shape[-1])]),
        torch.cat([cos, cos.new_ones(count, *cos.shape[1:])]),
        torch.cat([sin, sin.new_zeros(count, *sin.shape[1:])]),
    )
