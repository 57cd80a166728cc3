"""The policy's full-sequence forward: token ids + media -> logits, with padding handled.

megatron-bridge's `Qwen25VLModel.forward` computes multimodal rotary positions without an
attention mask (so padded rows get wrong positions) and never passes a KV cache. rlflow calls the
pieces itself instead, the same for every family (rlflow/model/family.py says what differs): the
family's rotary positions *with* the padding mask, the language model's embedding with the
vision tower's features scattered at the image/video pad tokens (and their deepstack part added
after the first layers, rlflow/model/families/qwen3vl/deepstack.py), then the megatron-core decoder with an
explicit causal+padding mask. Training, logprob recomputation and the simple generation path all
use this one function.
"""

from __future__ import annotations

import torch

from rlflow.model import sequence_parallel
from rlflow.model.families.qwen3vl import deepstack
from rlflow.model.family import of_core
from rlflow.model.media import Media


def media_slots(input_ids: torch.Tensor, prompt_mask: torch.Tensor | None, token_id: int):
    """Where visual embeddings go: pad tokens inside the prompt. A pad token the policy
    *generated* is ordinary text (as in HF and vLLM decoding), never a media slot."""
    slots = input_ids == token_id
    return slots if prompt_mask is None else slots & prompt_mask


def embed(
    core,
    input_ids: torch.Tensor,
    media: Media,
    prompt_mask: torch.Tensor | None = None,
    features: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
) -> deepstack.Embedded:
    """Token embeddings [T, B, H] with vision-tower features placed at the pad tokens.

    features: the (image, video) rows of `media` (`ModelFamily.vision_features`), when already
    computed (VisionCache); otherwise the vision tower runs here.
    """
    from rlflow.model.vision_cache import tower_features

    embeddings = language_model(core).embedding(input_ids=input_ids, position_ids=None)
    if features is None and (media.num_images or media.num_videos):
        features = tower_features(core, media)
    tokens = of_core(core).media_tokens(core.config)
    slots = [media_slots(input_ids, prompt_mask, t) for t in (tokens.image, tokens.video)]
    return deepstack.place(embeddings, slots, features or (None, None))


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """megatron-core's boolean mask [B, 1, T, T], True = blocked: causal plus padded keys."""
    length = attention_mask.shape[1]
    causal = torch.triu(
        torch.ones(length, length, dtype=torch.bool, device=attention_mask.device), 1
    )
    return causal[None, None] | ~attention_mask.bool()[:, None, None, :]


def language_model(core):
    """The megatron-core GPT language model: inside a vision-language model, or the model itself."""
    return getattr(core, "language_model", core)


def is_multimodal(core) -> bool:
    return of_core(core).multimodal


def run_language_model(core, positions, attention_mask, inputs: deepstack.Embedded | None, **kw):
    """The GPT language model on embedded inputs (None on later pipeline stages); under
    sequence parallelism each rank's decoder gets its slice of the sequence."""
    hidden, added = None, None
    if inputs is not None:
        hidden = sequence_parallel.scatter(core, inputs.hidden)
        added = sequence_parallel.scatter_deepstack(core, inputs.deepstack, inputs.hidden.shape)
    with deepstack.adding(added):
        return language_model(core)(
            input_ids=None,
            position_ids=positions,
            attention_mask=attention_mask,
            decoder_input=hidden,
            **kw,
        )


def policy_logits(
    core,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: Media,
    prompt_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [B, T, V/tp] for every position (vocab-sharded under tensor parallelism).

    prompt_mask [B, T] marks prompt tokens; media pad tokens outside it are generated text.
    Text-only models take right-padded rows: megatron-core numbers RoPE positions 0..T-1.
    Under sequence parallelism the rows get masked columns up to a multiple of the TP size.
    """
    length = input_ids.shape[1]
    if prompt_mask is None:
        input_ids, attention_mask = sequence_parallel.pad_columns(core, input_ids, attention_mask)
    else:
        input_ids, attention_mask, prompt_mask = sequence_parallel.pad_columns(
            core, input_ids, attention_mask, prompt_mask
        )
    positions = of_core(core).positions(core, input_ids, attention_mask, media, prompt_mask)
    inputs = embed(core, input_ids, media, prompt_mask) if core.pre_process else None
    logits = run_language_model(core, positions, attention_mask_4d(attention_mask), inputs)
    return logits[:, :length]
