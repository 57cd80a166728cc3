"""Qwen3-VL, dense and MoE: HF's vision tower with DeepStack + megatron-core's GPT language model
(dense, or megatron-core's MoE layer), with interleaved 3-D mrope.

What differs from Qwen2.5-VL, and where it lives:
- the vision tower's rows carry its DeepStack features, added to the outputs of the first decoder
  layers at the media tokens (`vision_features` here; rlflow/model/families/qwen3vl/deepstack.py adds them);
- the rotary spreads the (t, h, w) axes over the frequencies in turn (the model's own rotary
  module, rlflow/model/families/qwen3vl/model.py), and text after an image continues at the image's
  largest (h, w) extent (HF's `get_rope_index`, bound to the model);
- video frames are separate pad-token groups, each after a `<t seconds>` timestamp written by
  the processor; HF's rope index splits the video grid per frame;
- the checkpoint's on-disk weight names are its in-memory names.

Which path runs where: rlflow's own bridge registration (rlflow/model/families/qwen3vl/model.py: HF
tower + megatron-core GPT, local layer spec, grouped experts: rlflow/model/moe/experts.py) runs on every machine, CPU
and GPU, with or without Transformer Engine. megatron-bridge's own Qwen3-VL provider (its
Megatron vision model, TE layers and TE grouped experts) needs Transformer Engine, absent here
and on the lent GPUs; rlflow does not select it even where TE is installed, because rlflow's
generation decoder and packed attention read the local spec's modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlflow.errors import Diagnostic, RlflowError
from rlflow.model.families.qwen25vl import QwenVLFamily, cat_rows
from rlflow.model.presets import QWEN3VL_PRESET_NAMES
from rlflow.model.tiny import LanguageSizes


class Qwen3VL(QwenVLFamily):
    model_types = ("qwen3_vl",)
    architectures = ("Qwen3VLForConditionalGeneration",)
    builtins = ("tiny-qwen3vl",)
    rope = "mrope-interleaved"

    def register_bridge(self) -> None:
        from rlflow.model.families.qwen3vl import model as qwen3vl_model

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
        from rlflow.model.families.qwen3vl import deepstack

        layers = len(core.config.vision_config.deepstack_visual_indexes)
        deepstack.install(core.language_model, layers)

    def media_features(self, result):
        """Rows [H * (1 + DeepStack layers)]: the merger's output, then each DeepStack merger's."""
        import torch

        return torch.cat([cat_rows(result.pooler_output), *result.deepstack_features], dim=-1)

    def hf_module_name(self, exported: str) -> str:
        return exported  # transformers 5 writes Qwen3-VL under its in-memory names

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        return write_tiny_qwen3vl(out_dir, seed=seed, lm_head_scale=lm_head_scale)

    def builtin_config(self, name: str) -> dict:
        from rlflow.model.shape import builtin_keys

        sizes = Qwen3VLSizes()
        return builtin_keys(sizes, max_positions=sizes.max_position_embeddings)


FAMILY = Qwen3VL()


@dataclass(frozen=True)
class Qwen3VLSizes(LanguageSizes):
    """Shapes of a random Qwen3-VL. The defaults are the tiny CPU model's (head_dim 32 >= vLLM's
    CPU minimum); `QWEN3VL_PRESETS` holds the real shapes."""

    layers: int = 3
    head_dim: int = 32
    # Qwen3-VL's [24, 20, 20] of 64 frequencies, scaled to head_dim / 2 = 16
    mrope_section: tuple[int, int, int] = (6, 5, 5)
    max_position_embeddings: int = 4096
    vision_depth: int = 3
    vision_hidden: int = 64
    vision_intermediate: int = 128
    vision_heads: int = 2
    vision_position_embeddings: int = 64  # an 8 x 8 learned grid, resampled to each image's
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)


MOE_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2}  # the tiny Qwen3-VL-MoE's routing

# A preset: the language model's shapes, then the vision tower's, a few to a line.
# fmt: off
QWEN3VL_PRESETS = {
    # Qwen3-VL-4B-Instruct's shapes (its config.json), for GPU benchmarks with random weights
    "qwen3vl-4b": Qwen3VLSizes(
        vocab_size=151936, hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8,
        head_dim=128, tie_embeddings=True, rope_theta=5000000.0, mrope_section=(24, 20, 20),
        max_position_embeddings=262144,
        vision_depth=24, vision_hidden=1024, vision_intermediate=4096, vision_heads=16,
        vision_position_embeddings=2304, deepstack_visual_indexes=(5, 11, 17),
    ),
}
# fmt: on
assert tuple(QWEN3VL_PRESETS) == QWEN3VL_PRESET_NAMES, "rlflow/model/presets.py lists the presets"


def write_tiny_qwen3vl(
    out_dir: str | Path,
    *,
    seed: int,
    lm_head_scale: float = 1.0,
    moe: bool = False,
    sizes: Qwen3VLSizes = Qwen3VLSizes(),  # noqa: B008 - frozen, so one shared default is safe
    device: str = "cpu",
) -> Path:
    """A random Qwen3-VL (moe: Qwen3-VL-MoE) checkpoint, tiny by default: 3 decoder layers, a
    3-block tower whose blocks 0 and 1 feed DeepStack (decoder layers 0 and 1), 16-pixel
    patches; MoE: 4 experts, top-2. The tokenizer and chat template are the other tiny models'.
    `sizes` gives other shapes (QWEN3VL_PRESETS); off the CPU (`device`) the weights are made
    there in bf16 (a 4B-shaped model initialises in seconds on a GPU) and saved in bf16."""
    from rlflow.model.tiny import TinyModel, write_tiny

    def router(model) -> None:  # HF initialises the router to zeros: every expert would tie
        for layer in model.model.language_model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)

    tiny = TinyModel(
        _hf_classes(moe)[1],
        lambda ids, tokens: qwen3vl_config(sizes, ids, tokens, moe),
        init=router if moe else None,
        save_processor=_save_processor,
    )
    return write_tiny(out_dir, tiny, sizes, seed=seed, device=device, lm_head_scale=lm_head_scale)


def qwen3vl_config(sizes: Qwen3VLSizes, ids: dict[str, int], tokens: int, moe: bool = False):
    """The HF config of a random Qwen3-VL at `sizes` (ids: the media and special token ids;
    tokens: the tokenizer's length, a floor for the vocabulary)."""
    from rlflow.model.tiny import (
        language_config,
        media_token_config,
        token_ids_config,
        vision_config,
    )

    text = dict(
        **language_config(sizes, tokens),
        head_dim=sizes.head_dim,
        max_position_embeddings=sizes.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": sizes.rope_theta,
            "mrope_section": list(sizes.mrope_section),
            "mrope_interleaved": True,
        },
        **token_ids_config(ids),
    )
    if sizes.tie_embeddings:  # (left out when untied: the tiny checkpoint stays byte-identical)
        text["tie_word_embeddings"] = True
    if moe:
        text.update(MOE_EXPERTS, moe_intermediate_size=64)
    vision = vision_config(
        sizes,
        patch_size=16,
        num_position_embeddings=sizes.vision_position_embeddings,
        deepstack_visual_indexes=list(sizes.deepstack_visual_indexes),
    )
    config_cls, _ = _hf_classes(moe)
    return config_cls(
        text_config=text,
        vision_config=vision,
        **media_token_config(ids),
        tie_word_embeddings=sizes.tie_embeddings,
    )


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
