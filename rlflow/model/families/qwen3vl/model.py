"""Qwen3-VL (dense and MoE) as a Megatron model without Transformer Engine, registered with
megatron-bridge.

megatron-bridge 0.6.2 converts Qwen3-VL into its own `Qwen3VLModel`, whose provider hard-codes
Transformer Engine (`get_gpt_layer_with_transformer_engine_spec`, and `TENorm` in the vision
patch merger). This module follows the route rlflow took for Qwen2-VL instead: HF's vision tower
(`Qwen3VLVisionModel`, with its DeepStack mergers) kept as is, megatron-core's GPT language model
with the local layer spec (dense, or rlflow/model/moe/experts.py's MoE layer with grouped
experts), and HF Qwen3-VL's feature and rope-index methods bound to the model. Two pieces
make it Qwen3-VL:

* the language model's rotary module is replaced by `InterleavedMRoPE`: Qwen3-VL spreads the
  (t, h, w) axes over the frequencies in turn (HF: `Qwen3VLTextRotaryEmbedding`) instead of in
  three blocks (megatron-core's `MultimodalRotaryEmbedding`);
* the DeepStack features are added after the first decoder layers (rlflow/model/families/qwen3vl/deepstack.py).

Weights: megatron-bridge's own Qwen3-VL mappings for the language model (dense or MoE experts,
fused or per expert as the checkpoint stores them), the HF tower replicated under its HF names.
These registrations replace megatron-bridge's for the two architectures in this process, on
every machine: rlflow's generation decoder and packed attention read the local spec's modules,
so the TE model would not serve them even where TE is installed.
"""

from __future__ import annotations

import functools

import torch

from rlflow.errors import Diagnostic, RlflowError


@functools.cache
def register() -> None:
    """Define and register the bridge classes (once; megatron imports are heavy)."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.conversion.param_mapping import ReplicatedMapping
    from megatron.bridge.models.qwen_vl.qwen3_vl_bridge import Qwen3VLBridge, Qwen3VLMoEBridge
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    def mapping_registry(bridge) -> MegatronMappingRegistry:
        """The bridge's language-model mappings; the HF tower under its own names."""
        base = super(type(bridge), bridge).mapping_registry()
        kept = [m for m in base.mappings if not m.megatron_param.startswith("vision_model.")]
        tower = ReplicatedMapping(megatron_param="visual.**", hf_param="model.visual.**")
        return MegatronMappingRegistry(*kept, tower)

    def provider_bridge(bridge, hf_pretrained):
        provider = super(type(bridge), bridge).provider_bridge(hf_pretrained)
        _check_moe_layout(provider)
        # same fields, another provide()
        provider.__class__ = providers[hf_pretrained.config.model_type]
        provider.moe_grouped_gemm = False  # SequentialMLP: GroupedMLP needs grouped_gemm
        provider.moe_permute_fusion = False  # a Transformer Engine kernel
        return provider

    model_cls, providers = _model_classes()
    for source, base, model_type in (
        (Qwen3VLForConditionalGeneration, Qwen3VLBridge, "qwen3_vl"),
        (Qwen3VLMoeForConditionalGeneration, Qwen3VLMoEBridge, "qwen3_vl_moe"),
    ):
        cls = type(
            f"Rlflow{base.__name__}",
            (base,),
            {"mapping_registry": mapping_registry, "provider_bridge": provider_bridge},
        )
        MegatronModelBridge.register_bridge(
            source=source, target=model_cls, provider=providers[model_type], model_type=model_type
        )(cls)


def _check_moe_layout(provider) -> None:
    text = provider.hf_text_config
    dense_layers = list(getattr(text, "mlp_only_layers", None) or [])
    step = getattr(text, "decoder_sparse_step", 1)
    if provider.num_moe_experts and (dense_layers or step != 1):
        raise RlflowError(
            Diagnostic(
                "model.moe-layout",
                "the checkpoint mixes dense and MoE decoder layers (mlp_only_layers="
                f"{dense_layers}, decoder_sparse_step={step}), which rlflow does not load",
                help="rlflow loads Qwen3-VL-MoE checkpoints whose every layer is MoE",
            )
        )


@functools.cache
def _model_classes():
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.models.qwen_vl.modeling_qwen25_vl import Qwen25VLModel
    from megatron.bridge.models.qwen_vl.qwen3_vl_provider import (
        Qwen3VLModelProvider,
        Qwen3VLMoEModelProvider,
    )
    from transformers.models.qwen3_vl import modeling_qwen3_vl as hf

    from rlflow.model.family import finish_vl_model, init_vl_model, provide_frozen

    class Qwen3VLModel(Qwen25VLModel):
        """HF's Qwen3-VL tower + megatron-core GPT (local spec, interleaved mrope)."""

        def __init__(self, config, pre_process=True, post_process=True, vp_stage=None):
            init_vl_model(
                self, config, pre_process, post_process, vp_stage, tower=hf.Qwen3VLVisionModel
            )
            rotary = self.language_model.rotary_pos_emb
            self.language_model.rotary_pos_emb = InterleavedMRoPE.like(rotary)
            finish_vl_model(self, config, hf.Qwen3VLModel)

        def freeze(self, freeze_language_model, freeze_vision_model, freeze_vision_projection):
            """As Qwen2.5-VL's, with Qwen3-VL's position table and DeepStack mergers: a frozen
            tower is frozen whole (the vision cache relies on it)."""
            visual = getattr(self, "visual", None)
            parts = {
                "language": [self.language_model] if freeze_language_model else [],
                "tower": ["patch_embed", "pos_embed", "blocks"] if freeze_vision_model else [],
                "projection": ["merger", "deepstack_merger_list"]
                if freeze_vision_projection
                else [],
            }
            modules = parts["language"]
            if visual is not None:
                modules += [getattr(visual, n) for n in parts["tower"] + parts["projection"]]
            for module in modules:
                for param in module.parameters():
                    param.requires_grad = False

    class Provide:
        """What rlflow's providers change in megatron-bridge's Qwen3-VL ones (their fields kept):
        the model built, and no sequence parallelism forced under TP (rlflow's forward and
        generation place vision features on the whole sequence)."""

        return_dict = True  # HF's bound feature methods read it from the config

        def finalize(self) -> None:
            if (self.context_parallel_size or 1) > 1:
                self.calculate_per_token_loss = True
            GPTModelProvider.finalize(self)

        def provide(self, pre_process=None, post_process=None, vp_stage=None):
            return provide_frozen(self, Qwen3VLModel(self, pre_process, post_process, vp_stage))

    providers = {
        model_type: type(f"Rlflow{base.__name__}", (Provide, base), {})
        for model_type, base in (
            ("qwen3_vl", Qwen3VLModelProvider),
            ("qwen3_vl_moe", Qwen3VLMoEModelProvider),
        )
    }
    return Qwen3VLModel, providers


def _interleaved_base():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
    )

    return MultimodalRotaryEmbedding


class InterleavedMRoPE(_interleaved_base()):
    """Qwen3-VL's multimodal RoPE: frequency j takes its position from axis t, h or w in turn
    (h at j = 1, 4, 7, ..., w at j = 2, 5, 8, ... within their sections, t elsewhere)."""

    @classmethod
    def like(cls, rotary) -> InterleavedMRoPE:
        """This module with the frequencies and groups of megatron-core's mrope module."""
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        module.inv_freq = rotary.inv_freq
        module.rotary_interleaved = rotary.rotary_interleaved
        module.seq_len_interpolation_factor = rotary.seq_len_interpolation_factor
        module.cp_group = rotary.cp_group
        return module

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None):
        """position_ids [3, B, T] -> rotary angles [T, B, 1, D] (megatron-core's layout)."""
        from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

        seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        inv_freq = self.inv_freq[None, None, :, None].expand(3, seq.shape[1], -1, 1)
        freqs = (inv_freq @ seq[:, :, None, :].float()).transpose(2, 3)  # [3, B, T, D/2]
        mixed = freqs[0].clone()
        for axis in (1, 2):
            columns = slice(axis, mrope_section[axis] * 3, 3)
            mixed[..., columns] = freqs[axis, ..., columns]
        emb = torch.cat((mixed, mixed), dim=-1)[..., None, :].transpose(0, 1).contiguous()
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb
