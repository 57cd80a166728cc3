"""Nemotron Omni as a Megatron model without Transformer Engine, registered with megatron-bridge.

megatron-bridge 0.6.2's Omni bridge builds megatron-core's LLaVA model with a Transformer Engine
vision spec (`get_vit_layer_with_transformer_engine_spec`) and TE's hybrid stack spec, absent
here and on the lent GPUs. This module takes the route rlflow took for Qwen3-VL instead:
- the model (`NemotronOmniModel`): transformers' RADIO tower (hf.py's `radio_tower`, its q/k/v
  as one fused projection, the checkpoint's `attn.qkv`: same computation, one weight), the
  projector `mlp1` (hf.py), and megatron-core's `HybridModel` built by megatron-bridge's hybrid
  provider with Nemotron-H's local stack spec (rlflow/model/families/nemotron_h/model.py);
- the weights: rlflow's Nemotron-H bridge's mappings for the language model, under the
  checkpoint's `language_model.` prefix; the tower and `mlp1` replicated under their on-disk
  names (`vision_model.radio_model.model.*`, `mlp1.*`).
Sound encoders and the temporal video embedder are refused (`check_config`).
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlflow.errors import Diagnostic, RlflowError

_RADIO = "vision_model.radio_model.model."
# the tower's on-disk names (original RADIO) <-> its in-memory names (transformers' RadioModel)
TOWER_NAMES = (
    ("patch_generator.embedder.weight", "embeddings.patch_projection.weight"),
    ("patch_generator.pos_embed", "embeddings.position_embedding"),
    ("patch_generator.cls_token.token", "embeddings.cls_register_token"),
) + tuple(
    (f"blocks.*.{disk}.{leaf}", f"encoder.layer.*.{mine}.{leaf}")
    for disk, mine in (
        ("attn.qkv", "attention.attention.qkv"),
        ("attn.proj", "attention.output.dense"),
        ("norm1", "norm1"),
        ("norm2", "norm2"),
        ("mlp.fc1", "mlp.fc1"),
        ("mlp.fc2", "mlp.fc2"),
    )
    for leaf in ("weight", "bias")
)


def check_config(hf_config) -> None:
    """Refuse what rlflow does not build: a sound encoder, a temporal video embedder."""
    if getattr(hf_config, "sound_config", None) is not None:
        raise RlflowError(
            Diagnostic(
                "model.nemotron-omni-audio",
                "this Nemotron Omni checkpoint has a sound encoder (`sound_config` in config.json); "
                "rlflow takes no audio input and does not build it",
                help="train on images and video; audio input is not supported",
            )
        )
    if getattr(hf_config.vision_config, "separate_video_embedder", False):
        raise RlflowError(
            Diagnostic(
                "model.nemotron-omni-video-embedder",
                "this Nemotron Omni checkpoint has a separate temporal video patch embedder "
                "(vision_config.separate_video_embedder); rlflow feeds video frames as images",
                help="use a checkpoint without the temporal embedder",
            )
        )


class FusedQKV(nn.Module):
    """RADIO's self-attention with q, k and v as one projection (the checkpoint's `attn.qkv`):
    the computation of transformers' `RadioSelfAttention` (SDPA, no mask, 1/sqrt(d) scale)."""

    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.qkv_bias)

    def forward(self, hidden_states, **kwargs):
        batch, length, _ = hidden_states.shape
        qkv = self.qkv(hidden_states).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return out.transpose(1, 2).reshape(batch, length, -1), None


def megatron_tower(config):
    """hf.py's RADIO tower with fused q/k/v projections."""
    from rlflow.model.families.nemotron_omni.hf import radio_tower

    tower = radio_tower(config)
    for layer in tower.encoder.layer:
        layer.attention.attention = FusedQKV(config)
    return tower


@functools.cache
def register() -> None:
    """Define and register the bridge (once; megatron imports are heavy)."""
    import transformers
    from megatron.bridge.models.conversion import model_bridge
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import ReplicatedMapping

    from rlflow.model.families.nemotron_h import model as hybrid
    from rlflow.model.families.nemotron_omni import hf

    hf.register()
    hybrid.register()
    model_cls, provider_cls = _classes()

    def language_bridge(hf_config):
        return model_bridge.get_model_bridge(
            transformers.NemotronHForCausalLM, hf_config=hf_config.llm_config
        )

    class RlflowNemotronOmniBridge(model_bridge.MegatronModelBridge):
        def provider_bridge(self, hf_pretrained):
            config = hf_pretrained.config
            check_config(config)
            self._language = language_bridge(config)
            provider = self._language.provider_bridge(_Pretrained(config.llm_config))
            provider.__class__ = provider_cls  # same fields, another provide()
            vision = copy.deepcopy(config.vision_config)
            vision.spatial_merge_size = hf.MERGE  # pad tokens per 2 x 2 patches
            provider.vision_config = vision
            provider.hf_omni_config = config
            provider.img_context_token_id = config.img_context_token_id
            provider.video_context_token_id = config.video_context_token_id
            return provider

        def mapping_registry(self) -> MegatronMappingRegistry:
            language = getattr(self, "_language", None) or language_bridge(self.hf_config)
            kept = [_prefixed(m, "language_model.") for m in language.mapping_registry().mappings]
            tower = [
                ReplicatedMapping(megatron_param="vision_model." + mine, hf_param=_RADIO + disk)
                for disk, mine in TOWER_NAMES
            ]
            projector = ReplicatedMapping(megatron_param="mlp1.**", hf_param="mlp1.**")
            return MegatronMappingRegistry(*kept, *tower, projector)

    model_bridge.MegatronModelBridge.register_bridge(
        source=hf.MODEL_TYPE, target=model_cls, provider=provider_cls, model_type=hf.MODEL_TYPE
    )(RlflowNemotronOmniBridge)


class _Pretrained:
    """What a bridge's `provider_bridge` reads of an HF checkpoint: its config."""

    def __init__(self, config):
        self.config = config


def _prefixed(mapping, prefix: str):
    out = copy.copy(mapping)
    out.megatron_param = prefix + mapping.megatron_param
    if isinstance(mapping.hf_param, dict):
        out.hf_param = {k: prefix + v for k, v in mapping.hf_param.items()}
    else:
        out.hf_param = prefix + mapping.hf_param
    return out


@functools.cache
def _classes():
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    from megatron.bridge.utils.common_utils import hook_hf_module_setattr_for_tp_grad_sync
    from megatron.core.transformer.module import MegatronModule

    from rlflow.model.families.nemotron_omni.hf import projector
    from rlflow.model.family import provide_frozen

    class NemotronOmniModel(MegatronModule):
        """RADIO + mlp1 (first pipeline stage) + megatron-core's HybridModel."""

        def __init__(self, config, pre_process=True, post_process=True, vp_stage=None):
            super().__init__(config=config)
            self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
            if pre_process:
                self.vision_model = megatron_tower(config.vision_config)
                self.mlp1 = projector(config.hf_omni_config)
                hook_hf_module_setattr_for_tp_grad_sync(self.vision_model)
                hook_hf_module_setattr_for_tp_grad_sync(self.mlp1)
            self.language_model = config.provide_language_model(
                pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
            )
            self.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
            self.shared_embedding_or_output_weight = (
                self.language_model.shared_embedding_or_output_weight
            )

        def set_input_tensor(self, input_tensor) -> None:
            self.language_model.set_input_tensor(input_tensor)

        def freeze(self, freeze_language_model, freeze_vision_model, freeze_vision_projection):
            parts = [
                (freeze_language_model, "language_model"),
                (freeze_vision_model, "vision_model"),
                (freeze_vision_projection, "mlp1"),
            ]
            for frozen, name in parts:
                module = getattr(self, name, None)
                if frozen and module is not None:
                    for param in module.parameters():
                        param.requires_grad = False

    @dataclass
    class NemotronOmniProvider(HybridModelProvider):
        vision_config: Any = None  # transformers' RadioConfig (+ spatial_merge_size)
        hf_omni_config: Any = None
        img_context_token_id: int = -1
        video_context_token_id: int | None = None
        freeze_language_model: bool = False
        freeze_vision_model: bool = False
        freeze_vision_projection: bool = False

        def provide_language_model(self, pre_process=None, post_process=None, vp_stage=None):
            return HybridModelProvider.provide(self, pre_process, post_process, vp_stage)

        def provide(self, pre_process=None, post_process=None, vp_stage=None):
            return provide_frozen(
                self, NemotronOmniModel(self, pre_process, post_process, vp_stage)
            )

    return NemotronOmniModel, NemotronOmniProvider


# --- on disk (what the bridge exports) <-> hf.py's model in memory ------------------------------


@functools.cache
def _tower_rules():
    rules = []
    for disk, mine in TOWER_NAMES:
        pattern = re.escape(_RADIO + disk).replace(r"\*", r"(\d+)")
        rules.append((re.compile(pattern + "$"), "vision_model." + mine))
    return rules


def hf_module_name(exported: str) -> str:
    """One on-disk name -> hf.py's in-memory name (the tower's fused q/k/v keep `qkv`:
    `hf_state_dict` splits them)."""
    if exported.startswith("language_model.backbone."):
        return "language_model.model." + exported[len("language_model.backbone.") :]
    for pattern, target in _tower_rules():
        match = pattern.match(exported)
        if match:
            return target.replace("*", "{}").format(*match.groups())
    return exported


def hf_state_dict(exported: dict) -> dict:
    """The bridge's export as hf.py's state dict: names mapped, q/k/v split in three."""
    out = {}
    for name, tensor in exported.items():
        mapped = hf_module_name(name)
        if ".attention.attention.qkv." in mapped:
            for part, chunk in zip(("query", "key", "value"), tensor.chunk(3, dim=0)):
                out[mapped.replace(".qkv.", f".{part}.")] = chunk
        else:
            out[mapped] = tensor
    return out
