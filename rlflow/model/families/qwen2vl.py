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
from functools import partial
from pathlib import Path

from rlflow.model.families.qwen25vl import QwenVLFamily


class Qwen2VL(QwenVLFamily):
    model_types = ("qwen2_vl",)
    architectures = ("Qwen2VLForConditionalGeneration",)
    builtins = ("tiny-qwen2vl",)

    def register_bridge(self) -> None:
        _register_bridge()

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
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.qwen_vl.modeling_qwen25_vl import Qwen25VLModel
    from megatron.bridge.models.qwen_vl.qwen25_vl_bridge import Qwen25VLBridge
    from megatron.bridge.models.qwen_vl.qwen25_vl_provider import Qwen25VLModelProvider
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    from rlflow.model.family import finish_vl_model, init_vl_model, provide_frozen

    class Qwen2VLModel(Qwen25VLModel):
        """Qwen25VLModel with Qwen2-VL's HF tower and HF Qwen2-VL's methods bound to it."""

        def __init__(self, config, pre_process=True, post_process=True, vp_stage=None):
            init_vl_model(
                self,
                config,
                pre_process,
                post_process,
                vp_stage,
                tower=hf.Qwen2VisionTransformerPretrainedModel,
            )
            finish_vl_model(self, config, hf.Qwen2VLModel)

    class Qwen2VLModelProvider(Qwen25VLModelProvider):
        def provide(self, pre_process=None, post_process=None, vp_stage=None):
            return provide_frozen(self, Qwen2VLModel(self, pre_process, post_process, vp_stage))

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
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    from rlflow.model.tiny import (
        PRESETS,
        TinyModel,
        media_token_config,
        mrope_text_config,
        save_processor,
        write_tiny,
    )

    sizes = PRESETS["tiny"]

    def config(ids: dict[str, int], tokens: int):
        return Qwen2VLConfig(
            text_config=mrope_text_config(sizes, ids, tokens, tie=False),
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

    processor = partial(save_processor, processor_cls=Qwen2VLProcessor)
    tiny = TinyModel(Qwen2VLForConditionalGeneration, config, save_processor=processor)
    return write_tiny(out_dir, tiny, sizes, seed=seed, device=device, lm_head_scale=lm_head_scale)
