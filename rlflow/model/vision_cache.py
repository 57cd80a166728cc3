"""Vision-tower outputs reused within a step: computed once per prompt, not once per pass.

With `model.freeze_vision: true` the tower's weights never change, so a prompt's image and video
embeddings are the same in generation, in both logprob passes and in the update. A GRPO step
sees each prompt G times per pass and four passes per step: without this cache the tower runs
4 x G times per prompt. Entries are keyed by the prompt's `Media` object (the rollouts of one
prompt share it), hold a reference to it (so its id cannot be reused), and are dropped by
`clear()` at the start of every step.
"""

from __future__ import annotations

import torch

from rlflow.model.media import Media


class VisionCache:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._entries: dict[int, tuple[Media, torch.Tensor | None, torch.Tensor | None]] = {}
        self.computed = 0  # prompts whose media ran through the tower (tests read it)

    def clear(self) -> None:
        self._entries.clear()

    def features(self, core, rows: list[Media]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(image, video) embeddings of `rows`, concatenated in row order (None where absent)."""
        if not self.enabled:
            return tower_features(core, Media.concat(rows, _device()))
        missing = list({id(m): m for m in rows if id(m) not in self._entries}.values())
        if missing:
            images, videos = tower_features(core, Media.concat(missing, _device()))
            image_parts = _split(images, [_tokens(core, m.image_grid_thw) for m in missing])
            video_parts = _split(videos, [_tokens(core, m.video_grid_thw) for m in missing])
            for m, img, vid in zip(missing, image_parts, video_parts):
                self._entries[id(m)] = (m, img, vid)
            self.computed += sum(1 for m in missing if m.num_images or m.num_videos)
        picked = [self._entries[id(m)] for m in rows]
        return _cat([p[1] for p in picked]), _cat([p[2] for p in picked])


def tower_features(core, media: Media) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One batched run of the vision tower: (image, video) feature rows in item order (the
    family says what a row holds: `ModelFamily.vision_features`)."""
    from rlflow import parallel
    from rlflow.model.family import of_core

    if not (media.num_images or media.num_videos):
        return None, None
    return of_core(core).vision_features(core, media.to(parallel.info().device))


def _device():
    from rlflow import parallel

    return parallel.info().device


def _tokens(core, grid: torch.Tensor | None) -> int:
    if grid is None:
        return 0
    merge = core.config.vision_config.spatial_merge_size
    return int((grid.prod(-1) // merge**2).sum())


def _split(features: torch.Tensor | None, sizes: list[int]) -> list[torch.Tensor | None]:
    if features is None:
        return [None] * len(sizes)
    parts = list(torch.split(features, sizes))
    return [p if n else None for p, n in zip(parts, sizes)]


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [p for p in parts if p is not None]
    return torch.cat(present) if present else None
