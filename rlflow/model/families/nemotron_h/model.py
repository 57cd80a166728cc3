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
says; without TE, `register()` binds that name in hybrid_block.py to the local norm. The MoE
layers (`E`) take megatron-core's local MoE module with rlflow's MoE layer and grouped experts
(`moe_layer_spec`), and the provider HF's router settings (`configure_moe`).

The Mamba mixer's kernels: `mamba-ssm` where installed, else rlflow's PyTorch reference
(rlflow/compat/mamba_reference.py, installed by rlflow.compat.cpu_compat, patch 8; see
docs/hybrid-kernels.md). Three hooks make the model rlflow's (`install`):
* the trainer's packed rows: inside `packed_attention.packing(...)` each Mamba mixer gets the
  rows' `seq_idx` (PackedSeqParams), so the conv window and the scan state stop at row ends;
* each router keeps the checkpoint's correction bias (megatron-core would move it each step);
* megatron-core's `HybridModel.forward` has no `output_processor` (GPTModel's hook the packed
  trainer computes its target logprobs with): the model's forward is wrapped to call it on the
  decoder's hidden states.
"""

from __future__ import annotations

import functools
import types

from rlflow.errors import Diagnostic, RlflowError

# HF layer types rlflow builds (HF `layers_block_type` / the pattern's symbols)
SUPPORTED_LAYERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


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
            provider.moe_grouped_gemm = False  # megatron's GroupedMLP needs `grouped_gemm`
            provider.moe_permute_fusion = False  # Transformer Engine kernels
            provider.moe_router_fusion = False
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
        problems.append(f"hybrid_override_pattern `{pattern}` has layer types {unsupported}")
    if "E" in pattern:
        problems += _moe_problems(hf_config)
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
                help="rlflow builds Nemotron-H with Mamba-2 (M), attention (*), MLP (-) and "
                "MoE (E) layers as the published checkpoints have them (docs/hybrid-kernels.md)",
            )
        )


def _moe_problems(hf_config) -> list[str]:
    """MoE settings whose HF computation megatron-core's router or experts would not repeat."""
    problems = []
    if getattr(hf_config, "moe_latent_size", None):
        problems.append(f"moe_latent_size {hf_config.moe_latent_size} (latent MoE projections)")
    if not getattr(hf_config, "norm_topk_prob", True):
        problems.append("norm_topk_prob false (megatron-core's sigmoid router always normalises)")
    groups, topk_groups = hf_config.n_group or 1, hf_config.topk_group or 1
    topk = hf_config.num_experts_per_tok
    if groups > 1 and topk // topk_groups != 2:
        # HF ranks groups by their best two scores, megatron-core by their best topk/topk_group
        problems.append(
            f"group-limited routing with num_experts_per_tok {topk} / topk_group {topk_groups} "
            "!= 2 (HF ranks expert groups by their top-2 scores)"
        )
    return problems


def check_parallelism(provider) -> None:
    """Tensor parallelism (the Mamba mixer's heads, the attention heads and the MLPs split; the
    MoE layers' tokens split, rlflow/model/moe/experts.py) and expert parallelism are built;
    context and pipeline parallelism are refused, and so is sequence parallelism (the packed
    rows' `seq_idx` of each mixer is the whole sequence's)."""
    sizes = {
        "context_parallel_size": provider.context_parallel_size,
        "pipeline_parallel_size": provider.pipeline_model_parallel_size,
    }
    wider = [f"parallelism.{k}: {v}" for k, v in sizes.items() if v != 1]
    if provider.sequence_parallel:
        wider.append(
            "parallelism.sequence_parallel: on (or auto with tensor_parallel_size "
            f"{provider.tensor_model_parallel_size})"
        )
    if wider:
        raise RlflowError(
            Diagnostic(
                "model.nemotron-h-parallelism",
                "Nemotron-H is built for tensor, expert and data parallelism; the recipe sets "
                + ", ".join(wider),
                help="set context_parallel_size and pipeline_parallel_size to 1 and "
                "sequence_parallel to off (context, pipeline and sequence parallelism for "
                "hybrid models are not built: docs/hybrid-kernels.md)",
            )
        )


def configure_moe(provider, hf_config, model_cfg) -> None:
    """The MoE settings of the provider from `model.moe` (null: the checkpoint's), as the
    Qwen3-MoE family's (the top-k and the losses: rlflow/model/moe/experts.py's
    `configure_router`) but with Nemotron-H's router: sigmoid
    scores plus the checkpoint's correction bias (kept as loaded: megatron-core's aux-loss-free
    bias update is off, `install`), top-k renormalised and scaled, in float32 as HF computes it
    (router_dtype null); megatron-bridge's 1e-4 sequence load-balancing loss is not HF's (the
    checkpoint's config has no coefficient: off unless `model.moe.aux_loss_coeff` sets one)."""
    from rlflow.model.moe import experts

    cfg = model_cfg.moe
    provider.rlflow_grouped_experts = cfg.grouped_experts
    if "E" not in hf_config.hybrid_override_pattern:
        return
    experts.configure_router(provider, cfg, hf_config, int(hf_config.n_routed_experts))
    provider.moe_router_score_function = "sigmoid"
    provider.moe_router_enable_expert_bias = True
    provider.moe_router_bias_update_rate = 0.0
    provider.moe_router_topk_scaling_factor = float(hf_config.routed_scaling_factor)
    provider.moe_router_dtype = {None: "fp32", "float32": "fp32", "float64": "fp64"}[
        cfg.router_dtype
    ]


def local_hybrid_stack_spec(config=None):
    """megatron-core's hybrid stack with local (non-TE) modules and separate norms; its MoE
    layers are rlflow's (`moe_layer_spec`; `config.rlflow_grouped_experts`, default on)."""
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
        MoETransformerLayer,
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
    grouped = getattr(config, "rlflow_grouped_experts", True)

    def mlp_layer(module, mlp):  # the MLP and the MoE layers: a pre-norm MLP with a residual
        return ModuleSpec(
            module=module,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=LNImpl, mlp=mlp, mlp_bda=get_bias_dropout_add
            ),
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
            mlp_layer=mlp_layer(MLPLayer, mlp),
            moe_layer=mlp_layer(MoETransformerLayer, moe_layer_spec(grouped)),
        ),
    )


def moe_layer_spec(grouped: bool = True):
    """megatron-core's local MoE module (router, routed experts, shared expert) with rlflow's
    MoE layer (router replay, the TP token split) and, with `grouped`, its grouped experts
    (rlflow/model/moe/experts.py; squared-ReLU experts: `relu2_experts`)."""
    import dataclasses

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from rlflow.model.moe import experts

    core = get_moe_module_spec(use_te=False, num_experts=1, moe_grouped_gemm=False)
    submodules = core.keywords["submodules"]
    routed = submodules.experts
    if grouped:
        routed = functools.partial(
            experts.GroupedExperts(), submodules=routed.keywords["submodules"]
        )
    return functools.partial(
        experts._moe_layer_class(), submodules=dataclasses.replace(submodules, experts=routed)
    )


def install(core) -> None:
    """The packed-rows hook on every Mamba mixer, the routers' bias frozen, and the
    output_processor forward."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    for module in core.modules():
        if isinstance(module, MambaMixer) and not getattr(module, "_rlflow_packed", False):
            module.forward = types.MethodType(_packed_mixer_forward(module.forward), module)
            module._rlflow_packed = True
        if getattr(module, "expert_bias", None) is not None:
            # the checkpoint's routing bias, as HF uses it: megatron-core would count tokens
            # per expert (a torch.compile'd function) and move the bias after each step
            module.enable_expert_bias = False
            module.frozen_expert_bias = True
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
