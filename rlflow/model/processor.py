"""Samples -> prompts: chat template, tokenizer and the checkpoint's image/video processor.

Uses the HF processor saved with the checkpoint (tiny or real), so prompt tokens and pixel
layouts are exactly what the model family expects; the family (rlflow/model/family.py) says
whether prompts carry media at all.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlflow.errors import Diagnostic, RlflowError
from rlflow.model import family as families
from rlflow.model.media import Media, Prompt
from rlflow.recipe.schema import DataConfig


class CheckpointProcessor:
    """The checkpoint's own HF processor and tokenizer: what training prompts
    (PromptEncoder) and the server's chats (rlflow.serve.prompts) are encoded with."""

    def __init__(self, checkpoint: Path):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(checkpoint))
        # Vision-language checkpoints have a processor wrapping a tokenizer; text-only ones
        # resolve to the tokenizer itself.
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.multimodal = families.of_checkpoint(checkpoint).multimodal

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


class PromptEncoder(CheckpointProcessor):
    def __init__(self, checkpoint: Path, data_cfg: DataConfig):
        super().__init__(checkpoint)
        self.data_cfg = data_cfg

    def encode(self, sample) -> Prompt:
        """A Sample (rlflow.data) -> Prompt with expanded placeholders and processed media."""
        from rlflow.data.prompts import to_messages

        if not self.multimodal:
            return self._encode_text(sample)
        messages = to_messages(sample, self.data_cfg.prompt_suffix)
        text = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        kwargs = {}
        if sample.images:
            kwargs["images"] = list(sample.images)
        if sample.video is not None:
            fps = self.data_cfg.video.fps
            kwargs["videos"] = [list(sample.video)]
            kwargs["video_metadata"] = [
                {
                    "fps": fps,
                    "total_num_frames": len(sample.video),
                    "frames_indices": list(range(len(sample.video))),
                    "duration": len(sample.video) / fps,
                }
            ]
            kwargs["do_sample_frames"] = False
        enc = self.processor(text=[text], return_tensors="pt", **kwargs)
        token_ids = tuple(enc["input_ids"][0].tolist())
        self._check_length(sample, token_ids)
        media = Media(
            pixel_values=enc.get("pixel_values"),
            image_grid_thw=enc.get("image_grid_thw"),
            pixel_values_videos=enc.get("pixel_values_videos"),
            video_grid_thw=enc.get("video_grid_thw"),
            second_per_grid_ts=enc.get("second_per_grid_ts"),
        )
        return Prompt(
            sample_id=sample.id,
            text=text,
            token_ids=token_ids,
            media=media,
            images=tuple(sample.images),
            video=sample.video,
            video_fps=self.data_cfg.video.fps if sample.video is not None else None,
        )

    def _encode_text(self, sample) -> Prompt:
        if sample.images or sample.video is not None:
            raise RlflowError(
                Diagnostic(
                    "data.media-for-text-model",
                    f"sample `{sample.id}` has an image or video, but the model is text-only",
                    help="use data kind `text` with a text-only checkpoint, or a vision-language one",
                )
            )
        messages = [{"role": "user", "content": sample.question + self.data_cfg.prompt_suffix}]
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        token_ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self._check_length(sample, token_ids)
        return Prompt(
            sample_id=sample.id,
            text=text,
            token_ids=token_ids,
            media=Media(),
        )

    def _check_length(self, sample, token_ids) -> None:
        if len(token_ids) > self.data_cfg.max_prompt_tokens:
            raise RlflowError(
                Diagnostic(
                    "data.prompt-too-long",
                    f"sample `{sample.id}` gives a {len(token_ids)}-token prompt, over "
                    f"data.max_prompt_tokens={self.data_cfg.max_prompt_tokens}",
                    help="raise data.max_prompt_tokens, or use smaller images (data.image_size)",
                )
            )

    def completion_ids(self, text: str) -> list[int]:
        """Token ids of an assistant reply followed by the end-of-turn token (warm start targets)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_token_id]


def as_tensor(token_ids) -> torch.Tensor:
    return torch.tensor(list(token_ids), dtype=torch.long)
