"""The generation engine's forward for a hybrid language model (megatron-core's `HybridModel`:
Nemotron-H), written against the policy's own weight tensors as decoder.py is for GPT layers.

A hybrid stack is a sequence of four kinds of pre-norm residual layers, in the order of its
pattern: Mamba-2 mixers (`MambaLayer`), attention without rotary positions (`TransformerLayer`
with no MLP), squared-ReLU MLPs (`MLPLayer`) and mixtures of experts (`MoETransformerLayer`,
Nemotron-H's `E`: moe_decode.py's routed experts, the same code path as Qwen3-MoE's, with the
model's router (sigmoid scores, expert bias, grouped top-k, normalisation and scaling as
configured, through megatron-core's routing functions), squared-ReLU experts and the shared
expert; static shapes, so decode stays capturable). The engine's cache for it is a `HybridCache`
(mamba_state.py): the paged KV cache of the attention layers plus one conv and SSM state slot per
batch position holding a row.

* prefill (packed prompts, as decoder.py): a Mamba layer runs the chunked scan over the unique
  prompts (mamba_state.prefill: megatron-core's Triton varlen kernels on a GPU,
  rlflow/compat/mamba_reference.py's elsewhere) and leaves each prompt's final conv and SSM
  state in its first sample's slot; after the last layer the snapshot is copied to the slots of
  the prompt's other samples (`HybridCache.copy_samples`), as its keys and values are copied to
  their KV rows;
* decode (one token per row): a Mamba layer takes one conv and SSM step on the rows' slots
  through the cache's `slot_table` (a device tensor; mamba_state.decode: megatron-core's
  Triton ops in place on a GPU, gather, step and scatter elsewhere); the attention layers are
  decoder.py's (the flash-decode kernel on GPUs in bf16, the exact SDPA elsewhere) with an
  identity rotation (cos 1, sin 0). Nothing syncs the host, no
  tensor is allocated by size of data, and the state buffers never move, so the step is
  capturable as a CUDA graph (DecodeGraph); a graph's warm-up steps (lengths = cache.length)
  use the scratch slot 0, as they use the KV cache's scratch block.

MoE layers record each token's experts for router replay as decoder.py does, in the layer order
of the trainer's routers (`routing` [..., stack layers, k], -1 in the other layers). Under expert
parallelism the EP ranks run in lockstep as for Qwen3-MoE (moe_decode.py, lockstep.py): each
rank holds its experts / EP, every MoE layer all-gathers the ranks' tokens and reduce-scatters
the outputs; a rank's padding prefill sequence (or a pass with no rows of its own) runs its
Mamba layers on the scratch state slot.

Refused (RlflowError `generation.megatron-engine`): attention layers with their own MLP or
experts, stacks without both Mamba and attention layers, rotary positions;
FP8 decode (ValueError, as for MoE models); MoE layers the engine's routed-experts path does
not cover (ValueError from moe_decode.moe_weights: ungrouped experts, a gated shared expert).
`compile_decode` is not applied to hybrid layers (they run eagerly, captured in graphs on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlflow.errors import Diagnostic, RlflowError
from rlflow.generation.megatron import flash_decode
from rlflow.generation.megatron import mamba_state as mamba
from rlflow.generation.megatron.decoder import (
    Decoder,
    Dims,
    LayerWeights,
    _gather_kv,
    _norm_weight,
    _prefill_attention,
    _reduce,
    _reference_attention,
)
from rlflow.generation.megatron.mamba_state import HybridCache, MambaStates, MambaWeights
from rlflow.generation.megatron.moe_decode import MoEWeights, moe_mlp, moe_weights
from rlflow.model.packed_attention import Packing


def is_hybrid(core) -> bool:
    from rlflow.model.forward import language_model

    return type(language_model(core)).__name__ == "HybridModel"


def make_decoder(core, *, compile_decode: bool):
    """The engine's decoder for the policy's language model: GPT layers or a hybrid stack."""
    if is_hybrid(core):
        return HybridDecoder(core)
    return Decoder(core, compile_decode=compile_decode)


@dataclass
class HybridLayer:
    kind: str  # "mamba", "attention", "mlp" or "moe"
    norm: torch.Tensor
    index: int  # among the layers of its kind (KV cache layer, state layer); moe: stack position
    mamba: MambaWeights | None = None
    moe: MoEWeights | None = None
    attention: LayerWeights | None = None
    fc1: torch.Tensor | None = None
    fc2: torch.Tensor | None = None


class HybridDecoder(Decoder):
    """Views of a hybrid policy's weights plus its prefill and decode step (the engine's
    Decoder interface: `layers` are the attention layers, the KV cache's)."""

    def __init__(self, core):
        from megatron.core import parallel_state

        from rlflow.model.forward import language_model

        lm = language_model(core)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if lm.position_embedding_type != "none":
            _refuse(f"position_embedding_type {lm.position_embedding_type!r} (rotary)")
        config = lm.config
        self.embedding = lm.embedding
        self.final_norm = lm.decoder.final_norm.weight
        self.output_weight = (
            lm.shared_embedding_or_output_weight()
            if lm.share_embeddings_and_output_weights
            else lm.output_layer.weight
        )
        # tensor parallelism: megatron-core's tensors are this rank's shards already (the Mamba
        # mixer's heads and B/C groups, the attention heads, the MLP's columns); the row-parallel
        # outputs (out_proj, linear_proj, fc2) are summed over the group (decoder._reduce)
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        counts: dict[str, int] = {}
        self.stack = [_layer(layer, i, counts) for i, layer in enumerate(lm.decoder.layers)]
        self.layers = [h.attention for h in self.stack if h.kind == "attention"]
        self.mamba = [h.mamba for h in self.stack if h.kind == "mamba"]
        if not self.layers or not self.mamba:
            _refuse("the engine runs stacks with both Mamba and attention layers")
        attention = next(
            (
                x.self_attention
                for x, h in zip(lm.decoder.layers, self.stack)
                if h.kind == "attention"
            ),
            None,
        )
        heads, kv_heads = config.num_attention_heads, config.num_query_groups or 1
        head_dim = config.kv_channels or config.hidden_size // heads
        if attention is not None:
            heads = attention.num_attention_heads_per_partition
            kv_heads = attention.num_query_groups_per_partition
            head_dim = attention.hidden_size_per_attention_head
        kv_split = 1
        if attention is not None and (config.num_query_groups or heads) < tp:
            # TP above the KV heads: megatron-core's partition holds one KV head and the q
            # heads of its whole group; this rank attends with its share of them
            kv_split = tp // config.num_query_groups
            heads = config.num_attention_heads // tp
        scale = config.softmax_scale or head_dim**-0.5
        self.dims = Dims(
            heads, kv_heads, head_dim, config.layernorm_epsilon, scale, self.tp_group, kv_split
        )
        moe = next((h.moe for h in self.stack if h.moe is not None), None)
        self.topk = moe.topk if moe is not None else 0  # experts per token; 0: no MoE layers
        self.fp8 = False
        self._sms = 0

    @property
    def moe_layers(self) -> list[MoEWeights | None]:
        """Every stack layer's routed experts (None: not an MoE layer): the trainer's routers are
        numbered over the whole stack."""
        return [h.moe for h in self.stack]

    @staticmethod
    def state_bytes_per_row(decoder, dtype: torch.dtype) -> int:
        """Mamba state bytes one row holds (0 for a GPT decoder)."""
        layers = getattr(decoder, "mamba", [])
        return MambaStates.bytes_per_slot(layers, dtype)

    def set_fp8(self, enabled: bool) -> None:
        if enabled:
            raise ValueError(
                "FP8 decode of hybrid (Mamba) models is not implemented: set generation.fp8 "
                "to false"
            )

    def requantize(self) -> None:
        return None

    def new_cache(self, *, blocks: int, rows: int, max_len: int, dtype, device) -> HybridCache:
        d = self.dims
        return HybridCache(
            self.mamba, len(self.layers), blocks=blocks, rows=rows, max_len=max_len,
            kv_heads=d.kv_heads, head_dim=d.head_dim, dtype=dtype, device=device,
        )  # fmt: skip

    def rotary(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """No rotary positions: the identity rotation (cos 1, sin 0) [T, 1, D]."""
        count = positions.shape[-1]
        ones = torch.ones(count, 1, self.dims.head_dim, dtype=dtype, device=positions.device)
        return ones, torch.zeros_like(ones)

    def prefill(
        self, hidden: torch.Tensor, cos, sin, pack: Packing, cache: HybridCache,
        dest: torch.Tensor, src: torch.Tensor, routing=None, *, deepstack=None,
    ) -> torch.Tensor:  # fmt: skip
        """Packed prompts hidden [T, H] -> hidden [T, H] (before the final norm); keys/values
        to their rows' KV blocks (decoder.Decoder.prefill), each prompt's Mamba states to its
        first sample's slot, then copied to its other samples' (`cache.share` said which).
        routing [T, stack layers, k]: receives each token's experts in the MoE layers.
        Expert parallelism: a padding sequence after the prompts (prefill.packed_prompts)
        runs on the scratch state slot 0."""
        if deepstack is not None:
            raise ValueError("a hybrid language model takes no DeepStack features")
        slots = cache.prompt_slots
        padding = len(pack.lengths) - len(slots)
        if padding not in (0, 1) or hidden.shape[0] != pack.total:
            raise RuntimeError("HybridCache.share was not called for this prefill; a bug")
        slots = slots + [0] * padding
        d = self.dims
        for h in self.stack:
            if h.kind == "mamba":
                normed = F.rms_norm(hidden, hidden.shape[-1:], h.norm, d.eps)
                out = mamba.prefill(
                    h.mamba, normed, list(pack.lengths), cache.states, h.index, slots
                )
                hidden = hidden + _reduce(out, None, d)
            elif h.kind == "mlp":
                normed = F.rms_norm(hidden, hidden.shape[-1:], h.norm, d.eps)
                hidden = hidden + _reduce(_mlp(normed, h), None, d)
            elif h.kind == "moe":  # (norms its own input)
                hidden = hidden + _reduce(_moe(hidden, h, routing, d.eps), None, d)
            else:  # (norms its own input)
                keys = cache.keys[h.index].view(-1, d.kv_heads, d.head_dim)
                values = cache.values[h.index].view(-1, d.kv_heads, d.head_dim)
                hidden = _prefill_attention(
                    hidden, h.attention, cos, sin, pack, keys, values, dest, src, d
                )
        cache.copy_samples()
        return hidden

    def decode(
        self, tokens, positions, lengths, cache: HybridCache, rows: int, routing=None
    ) -> torch.Tensor:
        """One new token for each of the first `rows` batch positions -> fp32 logits [rows, V]
        (decoder.Decoder.decode's contract). A position's Mamba states are those of its slot;
        a warm-up step (lengths past the rows' span) uses the scratch slot. routing
        [rows, stack layers, k]: receives each row's experts in the MoE layers."""
        d = self.dims
        dtype = self.final_norm.dtype
        cos, sin = self.rotary(positions, dtype)
        slots = torch.where(lengths < cache.length, cache.slot_table[:rows], 0)
        hidden = self.embed(tokens[:, None])[:, 0]
        table = cache.table[:rows]
        for h in self.stack:
            if h.kind == "moe":  # (norms its own input)
                hidden = hidden + _reduce(_moe(hidden, h, routing, d.eps), None, d)
                continue
            normed = F.rms_norm(hidden, hidden.shape[-1:], h.norm, d.eps)
            if h.kind == "mamba":
                out = mamba.decode(h.mamba, normed, cache.states, h.index, slots)
            elif h.kind == "mlp":
                out = _mlp(normed, h)
            else:
                out = self._attend(normed, h.attention, cos, sin, cache, h.index, table, lengths)
                hidden = hidden + _reduce(out, h.attention.proj_bias, d)
                continue
            hidden = hidden + _reduce(out, None, d)
        return self.logits(hidden)

    def _attend(self, normed, w: LayerWeights, cos, sin, cache, index, table, lengths):
        d = self.dims
        qkv = _gather_kv(F.linear(normed, w.qkv_weight, w.qkv_bias), d)
        keys, values = cache.keys[index], cache.values[index]
        if flash_decode.available(qkv, d.head_dim):
            out = flash_decode.attention(
                qkv, cos[:, 0], sin[:, 0], keys, values, table, lengths, group=d.group,
                scale=d.scale, splits=self._splits(qkv.shape[0]), q_norm=None, k_norm=None,
                eps=d.eps,
            )  # fmt: skip
        else:
            out = _reference_attention(qkv, w, cos, sin, keys, values, table, lengths, d)
        return F.linear(out, w.proj_weight)  # (the caller sums it over TP, then adds the bias)


def _mlp(normed: torch.Tensor, h: HybridLayer) -> torch.Tensor:
    """Nemotron-H's MLP: fc2(relu(fc1(x))^2), no gate, no bias."""
    return F.linear(F.relu(F.linear(normed, h.fc1)).square(), h.fc2)


def _moe(hidden: torch.Tensor, h: HybridLayer, routing, eps: float) -> torch.Tensor:
    """Nemotron-H's MoE block (its norm, router, routed and shared experts: moe_decode.moe_mlp);
    the chosen experts go to routing[:, stack position]. Under tensor parallelism the output is
    this rank's partial sum: the caller reduces it, as decoder.Decoder._routed does."""
    out, chosen = moe_mlp(hidden, h.moe, eps)
    if routing is not None:
        routing[:, h.index] = chosen
    return out


def _layer(layer, position: int, counts: dict[str, int]) -> HybridLayer:
    """One layer's weights (views); counts: layers of each kind so far (their cache index)."""
    kind = type(layer).__name__
    if kind == "MambaLayer":
        index = counts["mamba"] = counts.get("mamba", -1) + 1
        return HybridLayer("mamba", layer.norm.weight, index, mamba=MambaWeights.of(layer.mixer))
    if kind == "MLPLayer":
        mlp = layer.mlp
        if not hasattr(mlp, "linear_fc1"):
            _refuse(f"layer {position} is a mixture of experts ({type(mlp).__name__})")
        return HybridLayer(
            "mlp", layer.pre_mlp_layernorm.weight, 0, fc1=mlp.linear_fc1.weight,
            fc2=mlp.linear_fc2.weight,
        )  # fmt: skip
    if kind == "MoETransformerLayer":
        moe = moe_weights(layer)
        if moe is None or type(getattr(layer, "self_attention", None)).__name__ != "IdentityOp":
            _refuse(f"layer {position} is a {kind} with attention or without experts")
        return HybridLayer("moe", moe.norm, position, moe=moe)
    attention = getattr(layer, "self_attention", None)
    if kind == "TransformerLayer" and type(getattr(layer, "mlp", None)).__name__ != "IdentityOp":
        _refuse(f"layer {position} is an attention layer with its own MLP or experts")
    if kind == "TransformerLayer" and hasattr(attention, "linear_qkv"):
        index = counts["attention"] = counts.get("attention", -1) + 1
        weights = LayerWeights(
            input_norm=layer.input_layernorm.weight, qkv_weight=attention.linear_qkv.weight,
            qkv_bias=attention.linear_qkv.bias, q_norm=_norm_weight(attention.q_layernorm),
            k_norm=_norm_weight(attention.k_layernorm), proj_weight=attention.linear_proj.weight,
            proj_bias=attention.linear_proj.bias, mlp_norm=None, fc1_weight=None,
            fc1_bias=None, fc2_weight=None, fc2_bias=None,
        )  # fmt: skip
        return HybridLayer("attention", layer.input_layernorm.weight, index, attention=weights)
    _refuse(f"layer {position} is a {kind}, which the engine does not run")


def _refuse(what: str):
    raise RlflowError(
        Diagnostic(
            "generation.megatron-engine",
            f"rlflow's Megatron generation engine does not run this hybrid model: {what}",
            help="set generation.backend: hf (docs/hybrid-kernels.md)",
        )
    )
