"""Mixture-of-experts pieces every MoE family shares: the grouped experts, the layer spec, the
provider settings from the recipe's `model.moe` keys, and what the dry run reads (no torch).

A family with routed experts calls `configure_provider` from its own `configure_provider`
(rlflow/model/families/qwen3_moe.py) and sizes its builtins in `builtin_config` (the dry run's
rules read them: rlflow/model/shape.py). That builds each layer from megatron-core's local spec
with two rlflow classes swapped in:

* `GroupedExperts`: megatron-core's `SequentialMLP` (same parameters, names, checkpoints and
  megatron-bridge mappings; SwiGLU experts, or Nemotron-H's squared-ReLU ones) whose
  per-expert weights live in one [experts, out, in] tensor, so
  the experts run as two grouped matrix products (`torch._grouped_mm`: a CUTLASS kernel on
  GPUs in bfloat16, an exact per-group loop in C++ on CPUs) with device-side offsets, never a
  Python loop over experts and no host sync (float32 on GPUs: see `grouped_mm`).
  `model.moe.grouped_experts: false` keeps SequentialMLP (the reference the tests compare
  against; benchmarks/moe_experts.py measures both).
* `MoELayer`: megatron-core's, with the router hook of rlflow/model/moe/routing.py (recording and
  replaying expert choices, load statistics), and under tensor parallelism (which rlflow runs
  without sequence parallelism) each TP rank dispatching its own slice of the tokens.

Expert parallelism is megatron-core's: `parallelism.expert_parallel_size` splits the experts over
ranks (`num_experts / EP` each), tokens travel by all-to-all; the expert-tensor-parallel size is
the tensor-parallel size (megatron-core's default).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from rlflow.errors import Diagnostic, RlflowError


def num_experts(config: dict[str, Any]) -> int:
    """Routed experts of a parsed HF config.json (0: a dense model). Vision-language configs
    keep the language model's settings in `text_config`. Pure: the dry run calls it."""
    from rlflow.model.shape import shape_of_config

    return shape_of_config(config).experts


def recipe_experts(checkpoint: str) -> int | None:
    """Routed experts of `model.checkpoint` (rlflow.model.shape.recipe_shape: a built-in's
    sizes or an HF directory's config.json); None when there is no config to read (the model
    rules say so). Imports no torch: the dry run calls it on the login node."""
    from rlflow.model.shape import recipe_shape

    shape = recipe_shape(checkpoint)
    return None if shape is None else shape.experts


# --- provider settings ---------------------------------------------------------------------------


def configure_provider(provider, hf_config, model_cfg) -> None:
    """The MoE settings of megatron-bridge's provider, from `model.moe` (null: the checkpoint's)."""
    cfg = model_cfg.moe
    text = getattr(hf_config, "text_config", hf_config)
    _refuse_unsupported(text)
    if provider.sequence_parallel:
        # Under sequence parallelism each TP rank's router sees only its slice of the tokens,
        # and router replay's recorded routes are per whole sequence: not implemented.
        raise RlflowError(
            Diagnostic(
                "moe.sequence-parallel",
                "sequence parallelism is not implemented for mixture-of-experts models "
                "(`parallelism.sequence_parallel` is on, or auto with tensor_parallel_size > 1)",
                help="set parallelism.sequence_parallel: off (rlflow's MoE layer then splits "
                "the tokens over the TP ranks itself)",
            )
        )
    experts = int(getattr(text, "num_experts", 0) or provider.num_moe_experts)
    configure_router(provider, cfg, text, experts)
    provider.transformer_layer_spec = functools.partial(layer_spec, grouped=cfg.grouped_experts)
    provider.moe_grouped_gemm = False  # megatron's own GroupedMLP needs the grouped_gemm package
    provider.moe_permute_fusion = False  # Transformer Engine kernels
    provider.moe_router_fusion = False
    provider.moe_router_pre_softmax = not bool(getattr(text, "norm_topk_prob", True))
    provider.moe_router_dtype = {None: None, "float32": "fp32", "float64": "fp64"}[cfg.router_dtype]


def configure_router(provider, moe_cfg, text_config, experts: int) -> None:
    """The router settings every MoE family takes alike from `model.moe` (null: the checkpoint's
    `text_config`): top-k (refused outside 1..`experts`), the load-balancing loss
    (`aux_loss_coeff`, null: the checkpoint's `router_aux_loss_coef`, off where it has none), the
    z-loss, and megatron-core's all-to-all token dispatcher. The family sets the rest (its
    score function, its router dtype)."""
    topk = moe_cfg.router_topk
    if topk is None:
        topk = int(text_config.num_experts_per_tok)
    if not 1 <= topk <= experts:
        raise RlflowError(
            Diagnostic(
                "moe.router-topk",
                f"`model.moe.router_topk` is {topk}, but the model has {experts} experts",
                help=f"choose 1..{experts}, or null for the checkpoint's num_experts_per_tok",
            )
        )
    coeff = moe_cfg.aux_loss_coeff
    if coeff is None:
        coeff = float(getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0)
    provider.moe_router_topk = topk
    provider.moe_token_dispatcher_type = "alltoall"
    provider.moe_router_load_balancing_type = "aux_loss" if coeff > 0 else "none"
    provider.moe_aux_loss_coeff = coeff
    provider.moe_z_loss_coeff = moe_cfg.z_loss_coeff or None


def _refuse_unsupported(text_config) -> None:
    """Checkpoint settings rlflow's MoE path does not implement: refused, never ignored."""
    problems = []
    if getattr(text_config, "mlp_only_layers", None):
        problems.append(f"mlp_only_layers {list(text_config.mlp_only_layers)} (dense layers)")
    if getattr(text_config, "decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step {text_config.decoder_sparse_step}")
    if getattr(text_config, "shared_expert_intermediate_size", 0):
        problems.append("shared experts")
    if problems:
        raise RlflowError(
            Diagnostic(
                "moe.unsupported",
                "the checkpoint's MoE layout is not supported: " + ", ".join(problems),
                help="rlflow trains MoE models whose every layer is routed experts (Qwen3-MoE)",
            )
        )


def layer_spec(config, grouped: bool = True):
    """megatron-core's local GPT layer spec with rlflow's MoE layer (and grouped experts)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    spec = local_layer_spec(config)
    mlp = spec.submodules.mlp
    moe_submodules = mlp.keywords["submodules"]
    experts = moe_submodules.experts
    if grouped:
        experts = functools.partial(GroupedExperts(), submodules=experts.keywords["submodules"])
    spec.submodules.mlp = functools.partial(
        _moe_layer_class(),
        submodules=dataclasses.replace(moe_submodules, experts=experts),
    )
    return spec


# --- the experts ---------------------------------------------------------------------------------


def grouped_mm(x, weight, offsets):
    """x [P, in] sorted by group, weight [groups, out, in], offsets [groups] int32 (cumulative
    ends) -> [P, out]; rows past offsets[-1] are left as the kernel leaves them.

    Three ways, one result, and none reads the offsets on the host where they live on a GPU
    (a host read fails inside CUDA-graph capture, which replays the engine's decode step):
    * torch's grouped kernel where it runs: on CPUs (an exact loop in C++), on GPUs only in
      bfloat16 on Hopper/Blackwell (its CUDA fallback for other dtypes and GPUs copies the
      offsets to the host). It wants 16-byte aligned strides, which tiny test shapes miss;
    * on CPUs otherwise, a loop over the groups with host-side offsets;
    * on GPUs otherwise (float32, older GPUs, misaligned shapes): every group's product over all
      rows, each row keeping its own group's (`_grouped_mm_on_device`)."""
    import torch

    if _grouped_kernel_runs(x, weight):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    if x.device.type != "cpu":
        return _grouped_mm_on_device(x, weight, offsets)
    ends = [0, *offsets.tolist()]
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for group in range(weight.shape[0]):
        rows = slice(ends[group], ends[group + 1])
        out[rows] = x[rows] @ weight[group].T
    return out


def _grouped_kernel_runs(x, weight) -> bool:
    """Whether torch._grouped_mm computes x's products without reading offsets on the host."""
    import torch

    bytes_per = x.element_size()
    if (x.shape[1] * bytes_per) % 16 or (weight.shape[1] * bytes_per) % 16:
        return False
    if x.device.type == "cpu":
        return True
    return (
        x.device.type == "cuda"
        and x.dtype == weight.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
    )


def _grouped_mm_on_device(x, weight, offsets):
    """grouped_mm with device-side work only (CUDA-graph capturable): each group's product over
    all P rows, selected per row, so `groups` times the FLOPs of the grouped kernel. That is the
    float32 path on GPUs, where the tiny recipes run; bfloat16 takes the grouped kernel."""
    import torch

    rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
    group = torch.bucketize(rows, offsets, right=True)  # offsets[g-1] <= row < offsets[g]
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for g in range(weight.shape[0]):
        out = torch.where((group == g).unsqueeze(1), x @ weight[g].T, out)
    return out


def swiglu(h):
    """SwiGLU of fc1's output [..., 2F] (gate, up halves) -> [..., F]."""
    import torch.nn.functional as F

    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def relu2(h):
    """Squared ReLU (not gated: Nemotron-H's experts and shared expert) [..., F] -> [..., F]."""
    import torch.nn.functional as F

    return F.relu(h).square()


ACTIVATIONS = {"swiglu": swiglu, "relu2": relu2}  # the expert activations the grouped path runs


def grouped_experts(x, fc1, fc2, offsets, probs, activation: str):
    """Routed experts on tokens sorted by expert: x [P, H], fc1 [E, F or 2F, H], fc2 [E, H, F],
    probs [P] -> [P, H], with `activation` one of ACTIVATIONS. The router weight scales the
    activation before fc2, in the same dtypes as megatron-core's MLP applies its
    `per_token_scale`. The trainer's GroupedExperts and the generation engine's routed experts
    (rlflow/generation/megatron/moe_decode.py) both run this."""
    act = ACTIVATIONS[activation](grouped_mm(x, fc1, offsets))
    act = (act * probs.unsqueeze(-1)).to(act.dtype)
    return grouped_mm(act, fc2, offsets)


def swiglu_experts(x, fc1, fc2, offsets, probs):
    """Routed SwiGLU experts (Qwen3-MoE's): fc1 [E, 2F, H] (`grouped_experts`)."""
    return grouped_experts(x, fc1, fc2, offsets, probs, "swiglu")


def relu2_experts(x, fc1, fc2, offsets, probs):
    """Routed squared-ReLU experts (not gated: Nemotron-H's): fc1 [E, F, H] (`grouped_experts`)."""
    return grouped_experts(x, fc1, fc2, offsets, probs, "relu2")


EXPERT_ACTIVATION = {swiglu_experts: "swiglu", relu2_experts: "relu2"}  # GroupedExperts._grouped


@functools.cache
def GroupedExperts():  # noqa: N802 - a class, built on first use (megatron imports are heavy)
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.moe.experts import SequentialMLP

    class _Stacked(torch.autograd.Function):
        """The experts' weights [out, in] as one [experts, out, in] view of their shared
        storage (a copy only if something separated them); gradients go back per expert."""

        @staticmethod
        def forward(ctx, *weights):
            return stacked(weights)

        @staticmethod
        def backward(ctx, grad):
            return tuple(grad.unbind(0))

    class GroupedExperts(SequentialMLP):
        """SequentialMLP's experts computed as grouped matrix products (see the module doc)."""

        def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
            super().__init__(num_local_experts, config, submodules, pg_collection, name)
            for linear in ("linear_fc1", "linear_fc2"):
                share_storage([getattr(e, linear) for e in self.local_experts])
            plain = (
                not config.add_bias_linear
                and not (config.fp8 or config.fp4 or config.moe_apply_probs_on_input)
                and config.activation_func_clamp_value is None
                and config.glu_linear_offset == 0.0
            )
            self._grouped = None  # which grouped computation, None: SequentialMLP's own
            if plain and config.gated_linear_unit and config.activation_func is F.silu:
                self._grouped = swiglu_experts
            relu2 = getattr(config.activation_func, "__name__", "") == "squared_relu"
            if plain and not config.gated_linear_unit and relu2:
                self._grouped = relu2_experts  # Nemotron-H's experts

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            if self._grouped is None:  # an expert layout the grouped path does not cover
                return super().forward(
                    permuted_local_hidden_states, tokens_per_expert, permuted_probs
                )
            x = permuted_local_hidden_states
            counts = tokens_per_expert.to(device=x.device, dtype=torch.int32)
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            fc1 = _Stacked.apply(*(e.linear_fc1.weight for e in self.local_experts))
            fc2 = _Stacked.apply(*(e.linear_fc2.weight for e in self.local_experts))
            return self._grouped(x, fc1, fc2, offsets, permuted_probs), None

        def stacked_weights(self):
            """(fc1 [E, 2F, H], fc2 [E, H, F]): views of the live weights (generation reads them)."""
            return tuple(
                stacked([getattr(e, name).weight.detach() for e in self.local_experts])
                for name in ("linear_fc1", "linear_fc2")
            )

    return GroupedExperts


def share_storage(linears) -> None:
    """Re-home the linears' weights as slices of one contiguous [n, out, in] tensor (the
    parameters keep their identity-level attributes: megatron's parallel flags and such)."""
    import torch

    weights = [linear.weight for linear in linears]
    block = torch.stack([w.detach() for w in weights])
    for i, (linear, old) in enumerate(zip(linears, weights)):
        new = torch.nn.Parameter(block[i], requires_grad=old.requires_grad)
        for key, value in vars(old).items():
            setattr(new, key, value)
        linear._parameters["weight"] = new


def stacked(weights):
    """[n] x [out, in] -> [n, out, in]: a view when the weights are consecutive slices of one
    storage (share_storage), else a copy."""
    import torch

    first = weights[0]
    step = first.numel()
    consecutive = all(
        w.is_contiguous()
        and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and w.storage_offset() == first.storage_offset() + i * step
        for i, w in enumerate(weights)
    )
    if not consecutive:
        return torch.stack(list(weights))
    return torch.as_strided(
        first, (len(weights), *first.shape), (step, *first.stride()), first.storage_offset()
    )


@functools.cache
def _moe_layer_class():
    import torch
    from megatron.core.tensor_parallel import (
        gather_from_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.moe.moe_layer import MoELayer as CoreMoELayer

    from rlflow.model.moe import routing

    class MoELayer(CoreMoELayer):
        """megatron-core's MoE layer with rlflow's router hook and a tensor-parallel split.

        rlflow runs tensor parallelism without sequence parallelism: every TP rank holds the
        whole sequence. Handed to megatron-core's dispatcher as is, each token would reach its
        experts once per TP rank, and the experts' weight gradients would be TP times too large
        (megatron-core refuses to train that way). So under TP the layer routes the whole
        sequence (identical on every TP rank: router and load-balancing loss as without TP),
        then each TP rank dispatches only its 1/TP slice of the tokens, exactly as under
        sequence parallelism, and the slices' outputs are all-gathered back."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.router.router_replay = routing.RouterHook(self.router)

        def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
            tp = self.attn_tp_group.size()
            if tp == 1 or self.config.sequence_parallel or intermediate_tensors is not None:
                return super().forward(hidden_states, intermediate_tensors, padding_mask)
            # a shared expert (Nemotron-H) is a TP-split MLP over the whole sequence
            shared = self.shared_experts_compute(hidden_states)
            if padding_mask is not None:
                padding_mask = padding_mask.transpose(0, 1).bool()
            shape = hidden_states.shape
            probs, routing_map = self.route(hidden_states, padding_mask)  # [N, E] each
            tokens = hidden_states.reshape(-1, 1, shape[-1])
            pad = -tokens.shape[0] % tp  # slices of equal size: repeat the last token
            if pad:
                tokens = torch.cat([tokens, tokens[-1:].expand(pad, -1, -1)])
                probs = torch.cat([probs, probs[-1:].expand(pad, -1)])
                routing_map = torch.cat([routing_map, routing_map[-1:].expand(pad, -1)])
            group = self.attn_tp_group
            tokens = scatter_to_sequence_parallel_region(tokens, group=group)
            probs = scatter_to_sequence_parallel_region(probs, group=group)
            rank, size = group.rank(), routing_map.shape[0] // tp
            routing_map = routing_map[rank * size : (rank + 1) * size]
            tokens, probs = self.preprocess(tokens, probs, routing_map)
            dispatched, probs = self.dispatch(tokens, probs)
            output, mlp_bias = self.routed_experts_compute(dispatched, probs)
            output = self.postprocess(self.combine(output), None)
            output = gather_from_sequence_parallel_region(
                output, tensor_parallel_output_grad=False, group=group
            )
            output = output[: output.shape[0] - pad].reshape(shape)
            return output if shared is None else output + shared, mlp_bias

    return MoELayer
