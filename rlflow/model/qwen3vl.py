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

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.errors import Diagnostic, RlflowError
from rlflow.model.presets import QWEN3VL_PRESET_NAMES
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

    def builtin_config(self, name: str) -> dict:
        from rlflow.model.shape import builtin_keys

        sizes = Qwen3VLSizes()
        return builtin_keys(sizes, max_positions=sizes.max_position_embeddings)


FAMILY = Qwen3VL()


@dataclass(frozen=True)
class Qwen3VLSizes:
    """Shapes of a random Qwen3-VL. The defaults are the tiny CPU model's (head_dim 32 >= vLLM's
    CPU minimum); `QWEN3VL_PRESETS` holds the real shapes. vocab_size is the embedding's rows
    (at least the tokenizer's tokenizer_vocab entries, which are locally built)."""

    vocab_size: int = 512
    tokenizer_vocab: int = 512
    hidden: int = 128
    intermediate: int = 384
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
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

QWEN3VL_PRESETS = {
    # Qwen3-VL-4B-Instruct's shapes (its config.json), for GPU benchmarks with random weights.
    "qwen3vl-4b": Qwen3VLSizes(
        vocab_size=151936,
        hidden=2560,
        intermediate=9728,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        tie_embeddings=True,
        rope_theta=5000000.0,
        mrope_section=(24, 20, 20),
        max_position_embeddings=262144,
        vision_depth=24,
        vision_hidden=1024,
        vision_intermediate=4096,
        vision_heads=16,
        vision_position_embeddings=2304,
        deepstack_visual_indexes=(5, 11, 17),
    ),
}
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
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import GenerationConfig

    from rlflow.model.tiny import SPECIAL_TOKENS, build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(sizes.tokenizer_vocab, seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = qwen3vl_config(sizes, ids, len(tokenizer), moe)
    config_cls, model_cls = _hf_classes(moe)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls._from_config(
            config, dtype=torch.float32 if device == "cpu" else torch.bfloat16
        ).eval()
    with torch.no_grad():
        if moe:  # HF initialises the router to zeros: every expert would tie
            for layer in model.model.language_model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.5)
        if lm_head_scale != 1.0 and not sizes.tie_embeddings:
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


def qwen3vl_config(sizes: Qwen3VLSizes, ids: dict[str, int], tokens: int, moe: bool = False):
    """The HF config of a random Qwen3-VL at `sizes` (ids: the media and special token ids;
    tokens: the tokenizer's length, a floor for the vocabulary)."""
    from rlflow.model.tiny import media_token_config

    text = dict(
        vocab_size=max(sizes.vocab_size, tokens),
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        head_dim=sizes.head_dim,
        max_position_embeddings=sizes.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": sizes.rope_theta,
            "mrope_section": list(sizes.mrope_section),
            "mrope_interleaved": True,
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    if sizes.tie_embeddings:  # (left out when untied: the tiny checkpoint stays byte-identical)
        text["tie_word_embeddings"] = True
    if moe:
        text.update(MOE_EXPERTS, moe_intermediate_size=64)
    vision = dict(
        depth=sizes.vision_depth,
        hidden_size=sizes.vision_hidden,
        intermediate_size=sizes.vision_intermediate,
        num_heads=sizes.vision_heads,
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=sizes.hidden,
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
