"""Processed visual inputs of prompts: the one media type every layer passes around."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class Media:
    """Processed visual inputs of one or more prompts, rows in prompt order (Qwen2.5-VL layout)."""

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

    @staticmethod
    def concat(items: list[Media]) -> Media:
        """Media of several prompts, in order (the vision tower consumes them in this order)."""
        out = {}
        for f in fields(Media):
            parts = [getattr(m, f.name) for m in items if getattr(m, f.name) is not None]
            out[f.name] = torch.cat(parts) if parts else None
        return Media(**out)
