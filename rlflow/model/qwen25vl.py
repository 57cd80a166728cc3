"""Qwen2.5-VL: HF vision tower (windowed attention) + Qwen2 language model with 3-D mrope.

megatron-bridge 0.6.2 converts it natively (`Qwen25VLModel`: the HF tower kept as is, the
language model a megatron-core GPT). Media become tokens through the checkpoint's
Qwen2.5-VL processor: one `<|image_pad|>`/`<|video_pad|>` per merged 2x2 patch group.
"""

from __future__ import annotations

from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError
from rlflow.model.family import MediaTokens, ModelFamily


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
        from rlflow.model.compat import vision_attention

        if getattr(core, "visual", None) is not None:
            vision_attention.install(core.visual)

    def hf_class(self):
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        from rlflow.model.tiny import write_tiny_checkpoint

        return write_tiny_checkpoint(out_dir, seed=seed, lm_head_scale=lm_head_scale)


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
