"""Nemotron-H as a megatron-core hybrid model without Transformer Engine, registered with
megatron-bridge.

megatron-bridge 0.6.2 converts `NemotronHForCausalLM` (its `NemotronHBridge`: config and weight
mappings, the Mamba in_proj and conv1d split per TP rank) into megatron-core's `HybridModel`,
but its provider's default stack spec is Transformer Engine's (`TELayerNormColumnParallelLinear`,
`TEDotProductAttention`, `TENorm`), absent here and on the lent GPUs. So rlflow keeps the
bridge's mappings and provider and gives the provider `local_hybrid_stack_spec()`: the same
layers with megatron-core's local modules (ColumnParallelLinear / RowParallelLinear, the local
DotProductAttention, the torch RMSNorm), the norm of each layer a separate module (the bridge maps
`norm.weight`, `input_layernorm.weight` and `pre_mlp_layernorm.weight` to HF's
`backbone.layers.*.norm.weight`). HybridStack makes its final norm a `TENorm` whatever the spec
says; without TE, `register()` binds that name in hybrid_block.py to the local norm.

The Mamba mixer's kernels: `mamba-ssm` where installed, else rlflow's PyTorch reference
(rlflow/compat/mamba_reference.py, installed by rlflow.compat.cpu_compat, patch 8; see
docs/hybrid-kernels.md). Two hooks make the model rlflow's (`install`):
* the trainer's packed rows: inside `packed_attention.packing(...)` each Mamba mixer gets the
  rows' `seq_idx` (PackedSeqParams), so the conv window and the scan state stop at row ends;
* megatron-core's `HybridModel.forward` has no `output_processor` (GPTModel's hook the packed
  trainer computes its target logprobs with): the model's forward is wrapped to call it on the
  decoder's hidden states.
"""

from __future__ import annotations

import functools
import types

from rlflow.errors import Diagnostic, RlflowError

# HF layer types rlflow builds (HF `layers_block_type` / the pattern's symbols)
SUPPORTED_LAYERS = {"M": "mamba", "*": "attention", "-": "mlp"}


@functools.cache
def register() -> None:
    """Define and register the bridge class (once; megatron imports are heavy)."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
    from megatron.bridge.models.nemotronh.nemotron_h_bridge import NemotronHBridge
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from rlflow.compat import cpu_compat

    cpu_compat.install_mamba_reference()  # a GPU without mamba-ssm runs the reference too
    _local_final_norm()

    from megatron.core.transformer.enums import AttnBackend

    class RlflowNemotronHBridge(NemotronHBridge):
        def provider_bridge(self, hf_pretrained):
            check_config(hf_pretrained.config)
            provider = super().provider_bridge(hf_pretrained)
            provider.hybrid_stack_spec = local_hybrid_stack_spec
            provider.activation_func = squared_relu
            provider.moe_grouped_gemm = False
            provider.moe_permute_fusion = False
            provider.moe_shared_expert_overlap = False
            provider.first_last_layers_bf16 = False
            # the hybrid provider asks for `flash`, whose NVTE_* environment variables clash
            # with those an earlier model of the process set (megatron-core asserts on them);
            # rlflow's local spec uses none of Transformer Engine's attention backends
            provider.attention_backend = AttnBackend.auto
            return provider

    MegatronModelBridge.register_bridge(
        source="NemotronHForCausalLM",
        target=HybridModel,
        provider=HybridModelProvider,
        model_type="nemotron_h",
    )(RlflowNemotronHBridge)


def _local_final_norm() -> None:
    """HybridStack builds its final norm as TENorm (hybrid_block.py), whatever the spec says;
    without Transformer Engine that module name is bound to megatron-core's local norm."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl
    from megatron.core.models.hybrid import hybrid_block

    if not transformer_engine.HAVE_TE:
        hybrid_block.TENorm = LNImpl


def squared_relu(x):
    """relu(x)^2, HF's `relu2`. megatron-core's own is wrapped in torch.compile (jit_fuser),
    which on a CPU builds C++ kernels for minutes before the first forward."""
    import torch

    return torch.nn.functional.relu(x).square()


def check_config(hf_config) -> None:
    """Refuse what the local hybrid model does not compute as HF does."""
    pattern = hf_config.hybrid_override_pattern
    unsupported = sorted(set(pattern) - set(SUPPORTED_LAYERS))
    problems = []
    if unsupported:
        problems.append(
            f"hybrid_override_pattern `{pattern}` has layer types {unsupported} "
            "('E': mixture-of-experts layers, not built yet)"
        )
    if getattr(hf_config, "num_nextn_predict_layers", 0):
        problems.append("num_nextn_predict_layers > 0 (multi-token prediction layers)")
    if hf_config.conv_kernel != 4:
        problems.append(f"conv_kernel {hf_config.conv_kernel} (megatron-core's mixer uses 4)")
    if not hf_config.use_conv_bias or hf_config.use_bias or hf_config.mamba_proj_bias:
        problems.append(
            "biases other than the conv1d's (use_conv_bias must be true, use_bias false)"
        )
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        problems.append("attention_bias or mlp_bias")
    if hf_config.mlp_hidden_act != "relu2" or hf_config.mamba_hidden_act != "silu":
        problems.append(
            f"activations {hf_config.mlp_hidden_act}/{hf_config.mamba_hidden_act} "
            "(relu2 for the MLP, silu for the mixer)"
        )
    if problems:
        raise RlflowError(
            Diagnostic(
                "model.nemotron-h-unsupported",
                "this Nemotron-H checkpoint's config.json has " + "; ".join(problems),
                help="rlflow builds Nemotron-H with Mamba-2 (M), attention (*) and MLP (-) layers",
            )
        )


def check_parallelism(provider) -> None:
    """TP, CP, PP and EP are refused until the hybrid model's paths for them are built."""
    sizes = {
        "tensor_parallel_size": provider.tensor_model_parallel_size,
        "context_parallel_size": provider.context_parallel_size,
        "pipeline_parallel_size": provider.pipeline_model_parallel_size,
        "expert_parallel_size": provider.expert_model_parallel_size,
    }
    wider = {k: v for k, v in sizes.items() if v != 1}
    if wider:
        raise RlflowError(
            Diagnostic(
                "model.nemotron-h-parallelism",
                "Nemotron-H runs on one model-parallel rank for now; the recipe sets "
                + ", ".join(f"parallelism.{k}: {v}" for k, v in wider.items()),
                help="set these to 1 (data parallelism works); the Mamba mixer's TP split, "
                "expert parallelism and CP/PP for hybrid models are not built yet",
            )
        )


def local_hybrid_stack_spec():
    """megatron-core's hybrid stack with local (non-TE) modules and separate norms."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    mixer = ModuleSpec(
        module=MambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
    )
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
        ),
    )
    mlp = ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=LNImpl, mixer=mixer, mamba_bda=get_bias_dropout_add
                ),
            ),
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=LNImpl,
                    self_attention=attention,
                    self_attn_bda=get_bias_dropout_add,
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=LNImpl, mlp=mlp, mlp_bda=get_bias_dropout_add
                ),
            ),
        ),
    )


def install(core) -> None:
    """The packed-rows hook on every Mamba mixer and the output_processor forward."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    for module in core.modules():
        if isinstance(module, MambaMixer) and not getattr(module, "_rlflow_packed", False):
            module.forward = types.MethodType(_packed_mixer_forward(module.forward), module)
            module._rlflow_packed = True
    if not getattr(core, "_rlflow_output_processor", False):
        core.forward = types.MethodType(_with_output_processor(core.forward), core)
        core._rlflow_output_processor = True


def _packed_mixer_forward(original):
    def forward(self, hidden_states, *args, packed_seq_params=None, **kwargs):
        from megatron.core.packed_seq_params import PackedSeqParams

        from rlflow.compat.mamba_reference import seq_idx_of
        from rlflow.model.packed_attention import _CURRENT

        pack = _CURRENT.get()
        if pack is not None and packed_seq_params is None:
            packed_seq_params = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=pack.cu_seqlens,
                cu_seqlens_kv=pack.cu_seqlens,
                max_seqlen_q=pack.max_len,
                max_seqlen_kv=pack.max_len,
                seq_idx=seq_idx_of(pack.cu_seqlens, hidden_states.shape[0]),
            )
        return original(hidden_states, *args, packed_seq_params=packed_seq_params, **kwargs)

    return forward


def _with_output_processor(original):
    def forward(self, *args, output_processor=None, output_processor_context=None, **kwargs):
        if output_processor is None:
            return original(*args, **kwargs)
        post_process, self.post_process = self.post_process, False
        try:
            hidden = original(*args, **kwargs)
        finally:
            self.post_process = post_process
        weight = None
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
        return output_processor(
            hidden_states=hidden,
            output_layer=self.output_layer,
            output_weight=weight,
            context=output_processor_context,
            scale_logits=self._scale_logits,
            config=self.config,
        )

    return forward
