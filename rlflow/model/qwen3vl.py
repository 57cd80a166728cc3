"""Qwen3-VL, dense and MoE: HF's vision tower with DeepStack + megatron-core's GPT language model
(dense, or megatron-core's MoE layer), with interleaved 3-D mrope.

What differs from Qwen2.5-VL, and where it lives:
- the vision tower's rows carry its DeepStack features, added to the outputs of the first decoder
  layers at the media tokens (`vision_features` here; rlflow/model/deepstack.py adds them);
- the rotary spreads the (t, h, w) axes over the frequencies in turn (the model's own rotary
  module, rlflow/model/qwen3vl_model.py), and text after an image continues at the image's
  largest (h, w) extent (HF's `get_rope_index`, bound to the model);
- video frames are separate pad-token groups, each after a `<t seconds>` timestamp written by
  the processor; HF's rope index splits the video grid per frame;
- the checkpoint's on-disk weight names are its in-memory names.

Which path runs where: rlflow's own bridge registration (rlflow/model/qwen3vl_model.py: HF
tower + megatron-core GPT, local layer spec, grouped experts: rlflow/model/moe.py) runs on every machine, CPU
and GPU, with or without Transformer Engine. megatron-bridge's own Qwen3-VL provider (its
Megatron vision model, TE layers and TE grouped experts) needs Transformer Engine, absent here
and on the lent GPUs; rlflow does not select it even where TE is installed, because rlflow's
generation decoder and packed attention read the local spec's modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.errors import Diagnostic, RlflowError
from rlflow.model.qwen25vl import QwenVLFamily

if TYPE_CHECKING:
    from rlflow.model.media import Media


class Qwen3VL(QwenVLFamily):
    model_types = ("qwen3_vl",)
    architectures = ("Qwen3VLForConditionalGeneration",)
    builtins = ("tiny-qwen3vl",)
    rope = "mrope-interleaved"

    def register_bridge(self) -> None:
        from rlflow.model import qwen3vl_model

        qwen3vl_model.register()

    def configure_provider(self, provider, hf_config, model_cfg) -> None:
        super().configure_provider(provider, hf_config, model_cfg)
        if provider.pipeline_model_parallel_size > 1:
            # The DeepStack features are made by the tower on the first stage and added on the
            # first layers; a later stage would silently run without them.
            raise RlflowError(
                Diagnostic(
                    "model.pipeline-parallel",
                    f"`parallelism.pipeline_parallel_size` is "
                    f"{provider.pipeline_model_parallel_size}; Qwen3-VL runs with 1",
                    help="set parallelism.pipeline_parallel_size: 1 (use tensor and expert "
                    "parallelism to split the model)",
                )
            )

    def install(self, core) -> None:
        from rlflow.model import deepstack

        layers = len(core.config.vision_config.deepstack_visual_indexes)
        deepstack.install(core.language_model, layers)

    def vision_features(self, core, media: Media):
        """Rows [H * (1 + DeepStack layers)]: the merger's output, then each DeepStack merger's."""
        import torch

        out = []
        for pixels, grid, features_fn in (
            (media.pixel_values, media.image_grid_thw, core.get_image_features),
            (media.pixel_values_videos, media.video_grid_thw, core.get_video_features),
        ):
            if pixels is None:
                out.append(None)
                continue
            result = features_fn(pixels, grid, return_dict=True)
            main = torch.cat(list(result.pooler_output))
            out.append(torch.cat([main, *result.deepstack_features], dim=-1))
        return out[0], out[1]

    def hf_class(self):
        from transformers import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration

    def hf_module_name(self, exported: str) -> str:
        return exported  # transformers 5 writes Qwen3-VL under its in-memory names

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        return write_tiny_qwen3vl(out_dir, seed=seed, lm_head_scale=lm_head_scale)


FAMILY = Qwen3VL()


def write_tiny_qwen3vl(
    out_dir: str | Path, *, seed: int, lm_head_scale: float = 1.0, moe: bool = False
) -> Path:
    """A tiny random Qwen3-VL (moe: Qwen3-VL-MoE) checkpoint: 3 decoder layers, a 3-block tower
    whose blocks 0 and 1 feed DeepStack (decoder layers 0 and 1), 16-pixel patches; MoE: 4
    experts, top-2. The tokenizer and chat template are the other tiny models'."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import GenerationConfig

    from rlflow.model.tiny import PRESETS, SPECIAL_TOKENS, build_tokenizer, media_token_config

    sizes = PRESETS["tiny"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(sizes.tokenizer_vocab, seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = sizes.hidden // sizes.heads
    text = dict(
        vocab_size=max(sizes.vocab_size, len(tokenizer)),
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=3,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        # Qwen3-VL's [24, 20, 20] of 64 frequencies, scaled to head_dim / 2 = 16
        rope_parameters={
            "rope_type": "default",
            "rope_theta": sizes.rope_theta,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    vision = dict(
        depth=3,
        hidden_size=sizes.vision_hidden,
        intermediate_size=sizes.vision_intermediate,
        num_heads=sizes.vision_heads,
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=sizes.hidden,
        num_position_embeddings=64,  # an 8 x 8 learned grid, resampled to each image's
        deepstack_visual_indexes=[0, 1],
    )
    config_cls, model_cls = _hf_classes(moe)
    config = config_cls(
        text_config=text, vision_config=vision, **media_token_config(ids), tie_word_embeddings=False
    )
    torch.manual_seed(seed)
    model = model_cls._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        if moe:  # HF initialises the router to zeros: every expert would tie
            for layer in model.model.language_model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.5)
        if lm_head_scale != 1.0:
            model.lm_head.weight.mul_(lm_head_scale)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    _save_processor(out, tokenizer)
    return out


def _hf_classes(moe: bool):
    if moe:
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        return Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    return Qwen3VLConfig, Qwen3VLForConditionalGeneration


def _save_processor(out: Path, tokenizer) -> None:
    """Qwen3-VL's processors at the tiny sizes: 16-pixel patches, 2 x 2 merged (32 pixels a
    token): 32 x 32 .. 256 x 256 pixels per image; a 112 x 112 image gives 16 tokens."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    from rlflow.model.tiny import CHAT_TEMPLATE

    image_processor = Qwen2VLImageProcessor(
        min_pixels=32 * 32, max_pixels=256 * 256, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256 * 4},
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        do_sample_frames=False,
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
