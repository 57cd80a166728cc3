"""The policy's full-sequence forward: token ids + media -> logits, with padding handled.

The model's family (rlflow/model/family.py) picks the path: 1-D RoPE families run the GPT
directly; mrope (Qwen-VL) families go through the pieces below. megatron-bridge's
`Qwen25VLModel.forward` computes multimodal rotary positions without an
attention mask (so padded rows get wrong positions) and never passes a KV cache. rlflow calls the
pieces itself instead: the language model's embedding, the HF vision tower's features scattered
at the image/video pad tokens, `get_rope_index` *with* the padding mask, then the megatron-core
decoder with an explicit causal+padding mask. Training, logprob recomputation and the simple
generation path all use this one function.
"""

from __future__ import annotations

import torch

from rlflow.model.family import of_core
from rlflow.model.media import Media


def placeholder_counts(media: Media, merge_size: int) -> tuple[int, int]:
    """How many image and video pad tokens the prompt must hold for this media."""

    def per_item(grid):
        return 0 if grid is None else int((grid.prod(-1) // merge_size**2).sum())

    return per_item(media.image_grid_thw), per_item(media.video_grid_thw)


def media_slots(core, input_ids: torch.Tensor, prompt_mask: torch.Tensor | None, token_id: int):
    """Where visual embeddings go: pad tokens inside the prompt. A pad token the policy
    *generated* is ordinary text (as in HF and vLLM decoding), never a media slot."""
    slots = input_ids == token_id
    return slots if prompt_mask is None else slots & prompt_mask


def mrope_positions(
    core,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: Media,
    prompt_mask: torch.Tensor | None = None,
):
    """An mrope family's 3-D positions [3, B, T] (padding ignored) and per-row deltas [B, 1]."""
    image_slots = media_slots(core, input_ids, prompt_mask, core.config.image_token_id)
    video_slots = media_slots(core, input_ids, prompt_mask, core.config.video_token_id)
    want = placeholder_counts(media, core.config.vision_config.spatial_merge_size)
    got = (int(image_slots.sum()), int(video_slots.sum()))
    if got != want:
        raise ValueError(
            f"the batch holds {got[0]} image and {got[1]} video pad tokens, but its "
            f"media give {want[0]} and {want[1]} embeddings"
        )
    token_types = torch.zeros_like(input_ids, dtype=torch.int)
    token_types[image_slots] = 1
    token_types[video_slots] = 2
    # HF's get_rope_index loops in Python over rows and media, with a host sync per small op
    # when its inputs are on a GPU (~0.25 s per GRPO-shaped prefill on an H200): it runs on the
    # host, and the positions go to the device once.
    cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in (
        input_ids, token_types, media.image_grid_thw, media.video_grid_thw,
        media.second_per_grid_ts, attention_mask,
    )]  # fmt: skip
    positions, deltas = core.get_rope_index(
        cpu[0], cpu[1], cpu[2], cpu[3], second_per_grid_ts=cpu[4], attention_mask=cpu[5]
    )
    return positions.to(input_ids.device), deltas.to(input_ids.device)


def embed(
    core,
    input_ids: torch.Tensor,
    media: Media,
    prompt_mask: torch.Tensor | None = None,
    features: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Token embeddings with vision-tower features placed at the pad tokens: [T, B, H].

    features: the (image, video) embeddings of `media`, when already computed (VisionCache);
    otherwise the vision tower runs here.
    """
    from rlflow.model.vision_cache import tower_features

    embeddings = core.language_model.embedding(input_ids=input_ids, position_ids=None)
    embeddings = embeddings.transpose(0, 1)  # [B, T, H]
    if features is None and (media.num_images or media.num_videos):
        features = tower_features(core, media)
    for feats, token_id in zip(
        features or (None, None), (core.config.image_token_id, core.config.video_token_id)
    ):
        if feats is None:
            continue
        slots = media_slots(core, input_ids, prompt_mask, token_id)
        if int(slots.sum()) != feats.shape[0]:
            raise ValueError(
                f"prompt holds {int(slots.sum())} pad tokens for token id {token_id} "
                f"but the media give {feats.shape[0]} embeddings"
            )
        embeddings = embeddings.masked_scatter(slots.unsqueeze(-1), feats.to(embeddings.dtype))
    return embeddings.transpose(0, 1).contiguous()


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
    """
    if of_core(core).rope == "1d":
        if media.num_images or media.num_videos:
            raise ValueError("a text-only model was given images or video")
        valid = attention_mask.bool()
        if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
            raise ValueError("text-only models need right-padded rows (padding after the tokens)")
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return core(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=attention_mask_4d(attention_mask),
        )
    positions, _ = mrope_positions(core, input_ids, attention_mask, media, prompt_mask)
    decoder_input = embed(core, input_ids, media, prompt_mask) if core.pre_process else None
    return core.language_model(
        input_ids=None,
        position_ids=positions,
        attention_mask=attention_mask_4d(attention_mask),
        decoder_input=decoder_input,
    )
