"""A rollout prompt and its processed visual inputs: the family-neutral types every layer passes.

`Media` holds the processor's tensors (pixel patches and grids); `Prompt` one prompt in the forms
the generation backends consume. Both are defined here only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class Media:
    """Processed visual inputs of one or more prompts, rows in prompt order (Qwen-VL layout)."""

    pixel_values: torch.Tensor | None = None  # [num_image_patches, C*T*P*P]
    image_grid_thw: torch.Tensor | None = None  # [num_images, 3]
    pixel_values_videos: torch.Tensor | None = None  # [num_video_patches, C*T*P*P]
    video_grid_thw: torch.Tensor | None = None  # [num_videos, 3]
    second_per_grid_ts: torch.Tensor | None = None  # [num_videos]

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    @property
    def num_videos(self) -> int:
        return 0 if self.video_grid_thw is None else int(self.video_grid_thw.shape[0])

    def to(self, device) -> Media:
        return Media(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                for f in fields(self)
            }
        )

    def layout(self) -> Media:
        """The grids and timings without the pixels: what positions and placement read."""
        return Media(None, self.image_grid_thw, None, self.video_grid_thw, self.second_per_grid_ts)

    @staticmethod
    def concat(items: list[Media], device=None) -> Media:
        """Media of several prompts, in order (the vision tower consumes them in this order).

        device: each item's tensors go there first and are joined there. A GRPO step's pixels
        are ~100 MB: joined on the host, they cost a CPU copy before the transfer (profiled in
        the prefill: benchmarks/grpo_shaped.md)."""
        out = {}
        for f in fields(Media):
            parts = [getattr(m, f.name) for m in items if getattr(m, f.name) is not None]
            if device is not None:
                parts = [p.to(device) for p in parts]
            out[f.name] = torch.cat(parts) if parts else None
        return Media(**out)


@dataclass(frozen=True)
class Prompt:
    """One rollout prompt, in the forms the different backends consume."""

    sample_id: str
    text: str  # chat-templated prompt, compact placeholders (one pad token per image/video)
    token_ids: tuple[int, ...]  # the processor's ids: one pad token per visual embedding
    media: Media  # processed pixels for the Megatron and HF backends
    images: tuple = ()  # raw PIL images, for backends that process media themselves (vLLM)
    video: tuple | None = None  # raw frames (PIL), same
    video_fps: float | None = None
