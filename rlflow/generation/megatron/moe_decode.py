"""Routed experts in rlflow's generation engine (prefill and decode), written against the
policy's own MoE weights, with static shapes so the decode step stays CUDA-graph capturable.

Every row is routed every step (finished and padding rows too: their outputs are discarded),
so shapes never depend on the routing. A layer:

1. routes: megatron-core's own gating and top-k (`router_gating_linear`,
   `topk_routing_with_score_function`), so generation and the trainer choose alike;
2. sorts the (token, choice) pairs by expert and counts them per expert on the device
   (`scatter_add`, no host sync); pairs for experts another rank holds sort last;
3. runs the experts as two grouped matrix products over the sorted pairs with device-side
   offsets (rlflow.model.moe.experts.grouped_experts: `torch._grouped_mm`), never a loop over
   experts, with the trainer's activation: SwiGLU (Qwen3-MoE) or squared ReLU (Nemotron-H),
   whichever the layer's GroupedExperts runs (`MoEWeights.activation`);
4. puts each pair's output back in token order and sums a token's k outputs in a fixed order;
5. adds the shared expert's output where the layer has one (Nemotron-H: a dense MLP with the
   experts' activation over every token, as megatron-core's SharedExpertMLP; a gated shared
   expert is refused).

The router is whatever the model's config says, through megatron-core's own function: softmax
top-k (Qwen3-MoE), or sigmoid scores with the checkpoint's expert bias, grouped top-k, top-k
normalisation and routed scaling (Nemotron-H).

Expert parallelism (EP > 1): the engine serves the EP ranks in lockstep rather than giving each
rank a copy of every expert. Each rank keeps only its `experts / EP` experts (the trainer's own
tensors, in place: no weight sync, and memory stays split as in training). In every MoE layer
the ranks all-gather their tokens (routed locally, with their choices and weights), apply their
local experts to the pairs routed to them, and reduce-scatter the sums back, so each rank gets
its own tokens' full outputs. That needs every EP rank to run the same number of prefills and
decode steps with the same row counts: MegatronGeneration agrees on them (rlflow/generation/
lockstep.py). Holding all experts per rank instead would need an all-gather of every expert
weight after each optimizer step and E/EP times the expert memory, which for the 235B-class
models EP exists for does not fit.

Under tensor parallelism each expert's fc1/fc2 are this rank's shards (megatron-core's expert
tensor parallelism equals TP); the decoder all-reduces the partial outputs as for a dense MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlflow.model.moe.experts import ACTIVATIONS, EXPERT_ACTIVATION, grouped_experts


@dataclass
class MoEWeights:
    """One MoE layer's router settings and expert weights (views of the policy's)."""

    norm: torch.Tensor  # the pre-MLP RMSNorm weight
    router: torch.Tensor  # [experts, H]
    router_bias: torch.Tensor | None
    expert_bias: torch.Tensor | None  # megatron's aux-loss-free bias (None for Qwen)
    fc1: torch.Tensor  # [local experts, 2F/tp (SwiGLU) or F/tp, H]
    fc2: torch.Tensor  # [local experts, H, F/tp]
    activation: str  # "swiglu" or "relu2" (rlflow.model.moe.experts.ACTIVATIONS)
    shared_fc1: torch.Tensor | None  # the shared expert's [2S/tp or S/tp, H]; None: none
    shared_fc2: torch.Tensor | None  # [H, S/tp]
    first: int  # global index of this rank's first expert
    topk: int
    pre_softmax: bool
    score_function: str
    scaling: float | None
    num_groups: int | None
    group_topk: int | None
    router_dtype: torch.dtype | None  # None: the hidden states' dtype
    ep_group: object | None  # expert-parallel process group when EP > 1


def moe_weights(layer) -> MoEWeights | None:
    """The MoE weights of a megatron layer built by rlflow/model/moe/experts.py, or None (dense)."""
    mlp = layer.mlp
    if not hasattr(mlp, "router"):
        return None
    from megatron.core import parallel_state

    experts, router, config = mlp.experts, mlp.router, mlp.config
    if not hasattr(experts, "stacked_weights"):
        raise ValueError(
            "rlflow's generation engine runs MoE models with grouped experts only: set "
            "model.moe.grouped_experts: true"
        )
    fc1, fc2 = experts.stacked_weights()
    activation = EXPERT_ACTIVATION.get(experts._grouped)
    if activation is None:
        raise ValueError(
            "rlflow's generation engine runs SwiGLU and squared-ReLU experts without biases, "
            "FP8 or a clamped activation; this MoE layer's experts are none of those"
        )
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None and shared.use_shared_expert_gate:
        raise ValueError(
            "rlflow's generation engine does not run gated shared experts: "
            "moe_shared_expert_gate is set"
        )
    ep_group = None
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        ep_group = parallel_state.get_expert_model_parallel_group()
    dtypes = {"fp32": torch.float32, "fp64": torch.float64, None: None}
    return MoEWeights(
        norm=layer.pre_mlp_layernorm.weight,
        router=router.weight,
        router_bias=router.bias,
        expert_bias=router.expert_bias,
        fc1=fc1,
        fc2=fc2,
        activation=activation,
        shared_fc1=None if shared is None else shared.linear_fc1.weight,
        shared_fc2=None if shared is None else shared.linear_fc2.weight,
        first=mlp.local_expert_indices[0],
        topk=config.moe_router_topk,
        pre_softmax=config.moe_router_pre_softmax,
        score_function=config.moe_router_score_function,
        scaling=config.moe_router_topk_scaling_factor,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        router_dtype=dtypes[config.moe_router_dtype],
        ep_group=ep_group,
    )


def route(normed: torch.Tensor, w: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """normed [N, H] -> (probs [N, k], experts [N, k]) exactly as the trainer's router."""
    from megatron.core.transformer.moe.moe_utils import (
        router_gating_linear,
        topk_routing_with_score_function,
    )

    logits = router_gating_linear(normed, w.router, w.router_bias, w.router_dtype or normed.dtype)
    return topk_routing_with_score_function(
        logits,
        w.topk,
        use_pre_softmax=w.pre_softmax,
        num_groups=w.num_groups,
        group_topk=w.group_topk,
        scaling_factor=w.scaling,
        score_function=w.score_function,
        expert_bias=w.expert_bias,
        dense_output=True,
    )


def moe_mlp(hidden: torch.Tensor, w: MoEWeights, eps: float):
    """The MoE block of a layer: hidden [N, H] -> (this rank's partial output [N, H] before the
    tensor-parallel reduction, the chosen experts [N, k])."""
    normed = F.rms_norm(hidden, hidden.shape[-1:], w.norm, eps)
    probs, chosen = route(normed, w)
    out = routed_experts(normed, chosen, probs, w)
    if w.shared_fc1 is not None:
        act = ACTIVATIONS[w.activation](F.linear(normed, w.shared_fc1))
        out = out + F.linear(act, w.shared_fc2)
    return out, chosen


def routed_experts(x, chosen, probs, w: MoEWeights) -> torch.Tensor:
    """x [N, H], chosen/probs [N, k] -> sum over each token's k experts [N, H] (static shapes)."""
    n, k = chosen.shape
    if w.ep_group is not None:
        x, chosen, probs = (_all_gather(t, w.ep_group) for t in (x, chosen, probs))
    local_experts = w.fc1.shape[0]
    local = chosen.reshape(-1) - w.first
    held = (local >= 0) & (local < local_experts)
    key = torch.where(held, local, local_experts)  # another rank's experts sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(local_experts + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offsets = torch.cumsum(counts[:local_experts], 0, dtype=torch.int32)
    y = grouped_experts(
        x.index_select(0, order // k), w.fc1, w.fc2, offsets, probs.reshape(-1)[order],
        w.activation,
    )  # fmt: skip
    if w.ep_group is not None:  # rows past offsets[-1] were not computed
        y = torch.where(held[order][:, None], y, 0)
    pairs = torch.empty_like(y).index_copy_(0, order, y)
    out = pairs.view(-1, k, y.shape[-1]).sum(1)
    if w.ep_group is not None:
        out = _reduce_scatter(out, w.ep_group, n)
    return out


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                      device=t.device)  # fmt: skip
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


def _reduce_scatter(t: torch.Tensor, group, n: int) -> torch.Tensor:
    out = torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.reduce_scatter_tensor(out, t.contiguous(), group=group)
    return out


class RoutingRecord:
    """The experts of every prompt and generated token of one generation pass (router replay).

    Rows' prompt tokens come from the packed prefill (one prompt's routing serves all of its
    samples), generated tokens from each decode step's static buffer; rows that had stopped
    keep -1. Everything stays on the device until `attach` copies it to the host once."""

    def __init__(self, decoder, rows: int, steps: int, device):
        moe = decoder.moe_layers  # one per layer of the trainer's router numbering
        self.layers, self.topk = len(moe), decoder.topk
        experts = next(w for w in moe if w is not None).router.shape[0]
        self.dtype = torch.int8 if experts <= 128 else torch.int16
        self.generated = self.buffer((steps, rows + 1), device)  # +1: the engine's trash row
        self.prompts: torch.Tensor | None = None

    def buffer(self, leading: tuple[int, ...], device) -> torch.Tensor:
        return torch.full((*leading, self.layers, self.topk), -1, dtype=self.dtype, device=device)

    def record_step(self, step: int, live_ids, live, step_routing) -> None:
        """Row live_ids[i] fed a token at `step`, routed as step_routing[i] (where live[i])."""
        column = self.generated[step]
        batch = live_ids.shape[0]
        column[live_ids] = torch.where(live[:, None, None], step_routing[:batch], column[live_ids])

    def attach(self, completions, cu_seqlens, row_slot) -> list:
        """Completions with `routing` [prompt + generated, layers, k] on the host."""
        import dataclasses

        prompts = self.prompts.cpu()
        starts = cu_seqlens.tolist()
        generated = self.generated.cpu()
        out = []
        for row, (completion, slot) in enumerate(zip(completions, row_slot.tolist())):
            prompt = prompts[starts[slot] : starts[slot + 1]]
            tokens = generated[: len(completion.token_ids), row]
            out.append(dataclasses.replace(completion, routing=torch.cat([prompt, tokens])))
        return out
