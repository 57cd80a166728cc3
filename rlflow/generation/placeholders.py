"""Compact vs expanded media placeholders, kept explicit.

The chat template writes one `<|image_pad|>` (or `<|video_pad|>`) per media item: the *compact*
form (what vLLM receives as text). The processor repeats it once per visual embedding: the
*expanded* form (what the Megatron forward consumes). Expanding an already expanded prompt is the
classic multimodal-RL bug (NeMo-RL #4192); `expanded_token_ids` is the one place that converts,
and it checks the counts either way.
"""

from __future__ import annotations

from rlflow.model.forward import placeholder_counts
from rlflow.model.media import Prompt


def expanded_token_ids(
    prompt: Prompt, image_token_id: int, video_token_id: int, merge_size: int
) -> list[int]:
    """The prompt's token ids with one pad token per visual embedding."""
    want_images, want_videos = placeholder_counts(prompt.media, merge_size)
    ids = list(prompt.token_ids)
    if prompt.media_tokens_expanded:
        got = (ids.count(image_token_id), ids.count(video_token_id))
        if got != (want_images, want_videos):
            raise ValueError(
                f"prompt {prompt.sample_id}: marked expanded but holds {got[0]} image and {got[1]} "
                f"video pad tokens; its media need {want_images} and {want_videos}"
            )
        return ids
    per_image = _per_item(prompt.media.image_grid_thw, merge_size)
    per_video = _per_item(prompt.media.video_grid_thw, merge_size)
    if (ids.count(image_token_id), ids.count(video_token_id)) != (len(per_image), len(per_video)):
        raise ValueError(
            f"prompt {prompt.sample_id}: compact form needs one pad token per media item "
            f"({len(per_image)} images, {len(per_video)} videos), found "
            f"{ids.count(image_token_id)} and {ids.count(video_token_id)}"
        )
    out: list[int] = []
    images, videos = iter(per_image), iter(per_video)
    for token in ids:
        if token == image_token_id:
            out += [token] * next(images)
        elif token == video_token_id:
            out += [token] * next(videos)
        else:
            out.append(token)
    return out


def _per_item(grid, merge_size: int) -> list[int]:
    return [] if grid is None else [int(n) for n in grid.prod(-1) // merge_size**2]
