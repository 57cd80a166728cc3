"""Qwen2.5-VL: HF vision tower (windowed attention) + Qwen2 language model with 3-D mrope.

megatron-bridge 0.6.2 converts it natively (`Qwen25VLModel`: the HF tower kept as is, the
language model a megatron-core GPT). Media become tokens through the checkpoint's
Qwen2.5-VL processor: one `<|image_pad|>`/`<|video_pad|>` per merged 2x2 patch group.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.errors import Diagnostic, RlflowError
from rlflow.model.family import MediaTokens, ModelFamily

if TYPE_CHECKING:
    from rlflow.model.media import Media, Prompt


class QwenVLFamily(ModelFamily):
    """What the Qwen vision-language families share: mrope, pad-token media, nested HF names."""

    multimodal = True
    rope = "mrope"

    def media_tokens(self, hf_config) -> MediaTokens:
        return MediaTokens(
            hf_config.image_token_id,
            hf_config.video_token_id,
            hf_config.vision_config.spatial_merge_size,
        )

    def prompt_ids(self, prompt: Prompt, tokens: MediaTokens) -> list[int]:
        """The processor's (expanded) prompt: one pad token per visual embedding. Expanding an
        already expanded prompt is the classic multimodal-RL bug (NeMo-RL #4192); the counts are
        checked here, where every backend and the trainer take a prompt's ids."""
        want = placeholder_counts(prompt.media, tokens.merge_size)
        ids = list(prompt.token_ids)
        got = (ids.count(tokens.image), ids.count(tokens.video))
        if got != want:
            raise ValueError(
                f"prompt {prompt.sample_id}: holds {got[0]} image and {got[1]} video pad tokens; "
                f"its media need {want[0]} and {want[1]}"
            )
        return ids

    def positions(self, core, input_ids, attention_mask, media: Media, prompt_mask=None):
        """3-D positions [3, B, T] from HF's `get_rope_index` (bound to the model), padding
        ignored. It loops in Python over rows and media, with a host sync per small op when its
        inputs are on a GPU (~0.25 s per GRPO-shaped prefill on an H200): it runs on the host,
        and the positions go to the device once."""
        from rlflow.model.forward import media_slots

        tokens = self.media_tokens(core.config)
        image_slots = media_slots(input_ids, prompt_mask, tokens.image)
        video_slots = media_slots(input_ids, prompt_mask, tokens.video)
        want = placeholder_counts(media, tokens.merge_size)
        got = (int(image_slots.sum()), int(video_slots.sum()))
        if got != want:
            raise ValueError(
                f"the batch holds {got[0]} image and {got[1]} video pad tokens, but its "
                f"media give {want[0]} and {want[1]} embeddings"
            )
        token_types = image_slots.int() + 2 * video_slots.int()  # 0 text, 1 image, 2 video
        cpu = [None if t is None else t.cpu() for t in (
            input_ids, token_types, media.image_grid_thw, media.video_grid_thw,
            media.second_per_grid_ts, attention_mask,
        )]  # fmt: skip
        positions, _ = core.get_rope_index(
            cpu[0], cpu[1], cpu[2], cpu[3], second_per_grid_ts=cpu[4], attention_mask=cpu[5]
        )
        return positions.to(input_ids.device)

    def vision_features(self, core, media: Media):
        out = []
        for pixels, grid, features_fn in (
            (media.pixel_values, media.image_grid_thw, core.get_image_features),
            (media.pixel_values_videos, media.video_grid_thw, core.get_video_features),
        ):
            result = None if pixels is None else features_fn(pixels, grid, return_dict=True)
            out.append(None if result is None else self.media_features(result))
        return out[0], out[1]

    def media_features(self, result):
        """One media kind's rows, from HF's tower output (`vision_features`): the merger's."""
        return cat_rows(result.pooler_output)

    def hf_generate_inputs(self, input_ids, tokens: MediaTokens) -> dict:
        # HF's generate computes mrope positions from the token types (0 text, 1 image, 2 video).
        types = (input_ids == tokens.image).long() + 2 * (input_ids == tokens.video).long()
        return {"mm_token_type_ids": types}

    def configure_provider(self, provider, hf_config, model_cfg) -> None:
        # megatron-bridge 0.6.2 keeps its default [16, 24, 24] instead of reading the checkpoint's.
        provider.mrope_section = list(mrope_section(hf_config))
        provider.freeze_vision_model = model_cfg.freeze_vision
        provider.freeze_vision_projection = model_cfg.freeze_vision
        provider.freeze_language_model = False

    def hf_module_name(self, exported: str) -> str:
        # transformers 5 nests the language model and the vision tower in memory.
        if exported.startswith("visual."):
            return "model." + exported
        if exported.startswith("model."):
            return "model.language_model." + exported[len("model.") :]
        return exported


class Qwen25VL(QwenVLFamily):
    model_types = ("qwen2_5_vl",)
    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    builtins = ("tiny-qwen25vl",)

    def install(self, core) -> None:
        from rlflow.compat import vision_attention

        if getattr(core, "visual", None) is not None:
            vision_attention.install(core.visual)

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        from rlflow.model.tiny import write_tiny_checkpoint

        return write_tiny_checkpoint(out_dir, seed=seed, lm_head_scale=lm_head_scale)

    def builtin_config(self, name: str) -> dict:
        from rlflow.model.shape import builtin_keys
        from rlflow.model.tiny import PRESETS

        return builtin_keys(PRESETS["tiny"], max_positions=PRESETS["tiny"].max_positions)


def placeholder_counts(media: Media, merge_size: int) -> tuple[int, int]:
    """How many image and video pad tokens a prompt with this media must hold."""

    def per_item(grid):
        return 0 if grid is None else int((grid.prod(-1) // merge_size**2).sum())

    return per_item(media.image_grid_thw), per_item(media.video_grid_thw)


def cat_rows(parts):
    import torch

    return torch.cat(list(parts))


def mrope_section(hf_config) -> list[int]:
    text = getattr(hf_config, "text_config", hf_config)
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(text, attr, None) or {}
        if "mrope_section" in params:
            return params["mrope_section"]
    raise RlflowError(
        Diagnostic(
            "model.mrope",
            "the checkpoint's config has no mrope_section",
            help="Qwen-VL configs set text_config.rope_parameters.mrope_section",
        )
    )


FAMILY = Qwen25VL()
