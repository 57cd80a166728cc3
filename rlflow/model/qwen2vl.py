"""Qwen2-VL: Qwen2.5-VL's language model and mrope, with Qwen2-VL's own vision tower.

megatron-bridge 0.6.2 has no Qwen2-VL bridge (`AutoBridge.from_hf_pretrained` answers "Model
architecture 'Qwen2VLForConditionalGeneration' is not yet supported"), and its Qwen3-VL provider
hard-codes Transformer Engine layers (`get_gpt_layer_with_transformer_engine_spec`, which fails
with "TypeError: 'NoneType' object is not callable" without TE). Qwen2-VL is the closer of the
two: the same Qwen2 decoder with 3-D mrope, only the tower differs (no window attention,
LayerNorm instead of RMSNorm, a plain MLP, no `tokens_per_second` in video positions). So this
family registers a bridge for it: Qwen2.5-VL's bridge and weight mappings (the on-disk names are
the same: `model.*`, `visual.*`, `lm_head.*`) building a model whose tower is HF's
`Qwen2VisionTransformerPretrainedModel`, with HF Qwen2-VL's feature and rope-index methods.
"""

from __future__ import annotations

import functools
from pathlib import Path

from rlflow.model.qwen25vl import QwenVLFamily


class Qwen2VL(QwenVLFamily):
    model_types = ("qwen2_vl",)
    architectures = ("Qwen2VLForConditionalGeneration",)
    builtins = ("tiny-qwen2vl",)

    def register_bridge(self) -> None:
        _register_bridge()

    def hf_class(self):
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration

    def write_tiny(self, out_dir: Path, name: str, seed: int, lm_head_scale: float = 1.0) -> Path:
        return write_tiny_qwen2vl(out_dir, seed=seed, lm_head_scale=lm_head_scale)

    def builtin_config(self, name: str) -> dict:
        from rlflow.model.shape import builtin_keys
        from rlflow.model.tiny import PRESETS

        return builtin_keys(PRESETS["tiny"], max_positions=PRESETS["tiny"].max_positions)


FAMILY = Qwen2VL()


@functools.cache
def _register_bridge() -> None:
    """Define and register the megatron-bridge classes (once; megatron imports are heavy)."""
    import types

    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.qwen_vl.modeling_qwen25_vl import Qwen25VLModel
    from megatron.bridge.models.qwen_vl.qwen25_vl_bridge import Qwen25VLBridge
    from megatron.bridge.models.qwen_vl.qwen25_vl_provider import Qwen25VLModelProvider
    from megatron.bridge.utils.common_utils import hook_hf_module_setattr_for_tp_grad_sync
    from megatron.core.transformer.module import MegatronModule
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    class Qwen2VLModel(Qwen25VLModel):
        """Qwen25VLModel with Qwen2-VL's HF tower and HF Qwen2-VL's methods bound to it."""

        def __init__(self, config, pre_process=True, post_process=True, vp_stage=None):
            MegatronModule.__init__(self, config=config)  # not Qwen25VLModel's: another tower
            self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
            if pre_process:
                self.visual = hf.Qwen2VisionTransformerPretrainedModel._from_config(
                    config.vision_config
                )
                hook_hf_module_setattr_for_tp_grad_sync(self.visual)
            self.language_model = config.provide_language_model(
                pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
            )
            self.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
            self.shared_embedding_or_output_weight = (
                self.language_model.shared_embedding_or_output_weight
            )
            for name in (
                "get_placeholder_mask",
                "get_image_features",
                "get_video_features",
                "get_rope_index",
                "get_vision_position_ids",
            ):
                setattr(self, name, types.MethodType(getattr(hf.Qwen2VLModel, name), self))

    class Qwen2VLModelProvider(Qwen25VLModelProvider):
        def provide(self, pre_process=None, post_process=None, vp_stage=None):
            model = Qwen2VLModel(self, pre_process, post_process, vp_stage)
            if (
                self.freeze_language_model
                or self.freeze_vision_model
                or self.freeze_vision_projection
            ):
                model.freeze(
                    freeze_language_model=self.freeze_language_model,
                    freeze_vision_model=self.freeze_vision_model,
                    freeze_vision_projection=self.freeze_vision_projection,
                )
            return model

    @MegatronModelBridge.register_bridge(
        source=Qwen2VLForConditionalGeneration,
        target=Qwen2VLModel,
        provider=Qwen2VLModelProvider,
        model_type="qwen2_vl",
    )
    class Qwen2VLBridge(Qwen25VLBridge):
        def provider_bridge(self, hf_pretrained):
            provider = super().provider_bridge(hf_pretrained)
            provider.__class__ = Qwen2VLModelProvider  # same fields; only provide() differs
            return provider


def write_tiny_qwen2vl(
    out_dir: str | Path, *, seed: int, lm_head_scale: float = 1.0, device: str = "cpu"
) -> Path:
    """A tiny random Qwen2-VL checkpoint (the tiny Qwen2.5-VL's sizes, tokenizer and processors)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLProcessor,
    )

    from rlflow.model.tiny import (
        PRESETS,
        SPECIAL_TOKENS,
        build_tokenizer,
        media_token_config,
        mrope_text_config,
        save_processor,
    )

    sizes = PRESETS["tiny"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(sizes.tokenizer_vocab, seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2VLConfig(
        text_config=mrope_text_config(sizes, ids, len(tokenizer), tie=False),
        vision_config=dict(
            depth=sizes.vision_depth,
            embed_dim=sizes.vision_hidden,
            hidden_size=sizes.hidden,  # the merger's output: the language model's width
            num_heads=sizes.vision_heads,
            mlp_ratio=sizes.vision_intermediate // sizes.vision_hidden,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        **media_token_config(ids),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    save_processor(out, tokenizer, Qwen2VLProcessor)
    return out
