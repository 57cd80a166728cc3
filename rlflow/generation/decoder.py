"""The language model's forward for generation, written against the policy's own weight tensors.

Generation reads the Megatron policy's parameters in place (views, no copies: an optimizer step
is visible to the next rollout with no weight sync) and runs the transformer as plain tensor
ops, which is what makes the decode step fast and CUDA-graph capturable:

* keys are stored *rotated* in a static cache [B, kv_heads, T, head_dim]: a decode step applies
  RoPE to the new token only;
* grouped-query attention without expanding KV heads: each KV head's queries attend as a group;
* one step has static shapes (the whole cache length is attended, unwritten slots masked), so
  on a GPU it is captured once as a CUDA graph and replayed (`DecodeGraph`).

Tensor parallelism: the policy's column/row-parallel weights are this rank's shards; the two
row-parallel outputs (attention projection, MLP down-projection) are all-reduced here.
The math mirrors megatron-core's local layer spec (RMSNorm, QKV with bias, SwiGLU MLP);
tests/generation compares it token for token with HF transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # per-head RMSNorm of queries and keys (Qwen3); None without
    k_norm: torch.Tensor | None
    proj_weight: torch.Tensor
    proj_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    fc1_weight: torch.Tensor
    fc1_bias: torch.Tensor | None
    fc2_weight: torch.Tensor
    fc2_bias: torch.Tensor | None


class Decoder:
    """Views of the policy's language-model weights plus the step functions that use them."""

    def __init__(self, core, compile_decode: bool = False):
        from rlflow.model.forward import language_model

        lm = language_model(core)
        config = lm.config
        attention = lm.decoder.layers[0].self_attention
        self.heads = attention.num_attention_heads_per_partition
        self.kv_heads = attention.num_query_groups_per_partition
        self.head_dim = attention.hidden_size_per_attention_head
        self.eps = config.layernorm_epsilon
        self.scale = config.softmax_scale or self.head_dim**-0.5
        self.embedding = lm.embedding
        self.inv_freq = lm.rotary_pos_emb.inv_freq
        self.rotary = lm.rotary_pos_emb
        self.mrope_section = getattr(lm, "mrope_section", None)
        self.final_norm = lm.decoder.final_layernorm.weight
        self.output_weight = (
            lm.shared_embedding_or_output_weight()
            if lm.share_embeddings_and_output_weights
            else lm.output_layer.weight
        )
        self.tp_group = None
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.layers = [_weights(layer) for layer in lm.decoder.layers]
        self.dims = Dims(
            self.heads, self.kv_heads, self.head_dim, self.eps, self.scale, self.tp_group
        )
        # Decode only: fuses each layer's norms, rotary and elementwise work into fewer kernels.
        # One compiled graph serves every layer (same shapes), so it compiles once.
        self._compiled_layer = torch.compile(layer_step, dynamic=False) if compile_decode else None

    # --- pieces ----------------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, S] -> [B, S, H] (megatron's vocab-parallel embedding does the TP reduction)."""
        return self.embedding(input_ids=tokens, position_ids=None).transpose(0, 1)

    def rotary_prefill(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, S, D] from positions: Qwen2.5-VL's 3-D [3, B, S] (megatron's mrope),
        or plain [B, S] for text-only models."""
        if positions.dim() == 2:
            return self._plain_rotary(positions, dtype)
        freqs = self.rotary(positions, self.mrope_section).permute(1, 2, 0, 3)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def rotary_decode(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, 1, D] for generated (text) tokens, whose three mrope axes coincide."""
        return self._plain_rotary(positions[:, None], dtype)

    def _plain_rotary(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq.float()  # [B, S, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, S, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] -> fp32 logits [B, V] over the full vocabulary."""
        normed = F.rms_norm(hidden, hidden.shape[-1:], self.final_norm, self.eps)
        logits = F.linear(normed, self.output_weight).float()
        if self.tp_group is not None:
            shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.tp_group))]
            dist.all_gather(shards, logits, group=self.tp_group)
            logits = torch.cat(shards, dim=-1)
        return logits

    # --- the transformer ------------------------------------------------------------------------

    def forward(
        self,
        hidden: torch.Tensor,
        cos,
        sin,
        cache: KVCache,
        slot: torch.Tensor | int,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [B, S, H] for cache slots slot..slot+S-1 -> hidden [B, S, H] (before final norm).

        mask: additive [B, 1, S, T] (0 = attend, -inf = blocked) over the cache keys attended.
        S > 1 is a prefill written at slot 0; S == 1 is a decode step at a (tensor) slot.
        """
        step = (
            self._compiled_layer
            if (self._compiled_layer and not isinstance(slot, int))
            else layer_step
        )
        for index, w in enumerate(self.layers):
            hidden = step(
                hidden, w, cos, sin, cache.keys[index], cache.values[index], slot, mask, self.dims
            )
        return hidden


@dataclass(frozen=True)
class Dims:
    heads: int  # query heads on this rank
    kv_heads: int
    head_dim: int
    eps: float
    scale: float
    tp_group: object | None


def layer_step(hidden, w: LayerWeights, cos, sin, keys, values, slot, mask, dims: Dims):
    """One transformer layer over new tokens; writes their keys/values into the layer's cache."""
    normed = F.rms_norm(hidden, hidden.shape[-1:], w.input_norm, dims.eps)
    hidden = hidden + _attention(normed, w, cos, sin, keys, values, slot, mask, dims)
    normed = F.rms_norm(hidden, hidden.shape[-1:], w.mlp_norm, dims.eps)
    gate, up = F.linear(normed, w.fc1_weight, w.fc1_bias).chunk(2, dim=-1)
    return hidden + _reduce(F.linear(F.silu(gate) * up, w.fc2_weight), w.fc2_bias, dims)


def _attention(x, w: LayerWeights, cos, sin, keys, values, slot, mask, dims: Dims):
    batch, length, _ = x.shape
    group = dims.heads // dims.kv_heads
    qkv = F.linear(x, w.qkv_weight, w.qkv_bias)
    # megatron's fused QKV layout per query group: [q_1..q_group, k, v] x head_dim
    qkv = qkv.view(batch, length, dims.kv_heads, group + 2, dims.head_dim)
    q = qkv[:, :, :, :group].permute(0, 2, 3, 1, 4)  # [B, kv, group, S, D]
    k = qkv[:, :, :, group].transpose(1, 2)  # [B, kv, S, D]
    v = qkv[:, :, :, group + 1].transpose(1, 2)
    if w.q_norm is not None:
        q = F.rms_norm(q, q.shape[-1:], w.q_norm, dims.eps)
        k = F.rms_norm(k, k.shape[-1:], w.k_norm, dims.eps)
    q = _rotate(q, cos[:, :, None], sin[:, :, None])
    k = _rotate(k, cos, sin)
    if isinstance(slot, int):
        keys[:, :, slot : slot + length] = k
        values[:, :, slot : slot + length] = v
        keys, values = keys[:, :, : slot + length], values[:, :, : slot + length]
    else:  # decode under a CUDA graph: the slot is a device tensor, the shapes never change
        keys.index_copy_(2, slot, k)
        values.index_copy_(2, slot, v)
    q = q.reshape(batch, dims.kv_heads, group * length, dims.head_dim)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=_group_mask(mask, group), scale=dims.scale
    )
    out = out.view(batch, dims.kv_heads, group, length, dims.head_dim)
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, length, dims.heads * dims.head_dim)
    return _reduce(F.linear(out, w.proj_weight), w.proj_bias, dims)


def _reduce(x: torch.Tensor, bias: torch.Tensor | None, dims: Dims) -> torch.Tensor:
    """Row-parallel output: sum the tensor-parallel partial results, then add the bias."""
    if dims.tp_group is not None:
        dist.all_reduce(x, group=dims.tp_group)
    return x if bias is None else x + bias


class KVCache:
    """Static per-layer key/value buffers [B, kv_heads, T, head_dim]; keys are stored rotated."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (batch, kv_heads, length, head_dim)
        self.length = length
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class DecodeGraph:
    """One decode step captured as a CUDA graph for a fixed (batch, cache length); replayed per token."""

    def __init__(self, decoder: Decoder, cache: KVCache, dtype: torch.dtype):
        device = cache.keys[0].device
        batch = cache.keys[0].shape[0]
        self.decoder, self.cache, self.dtype = decoder, cache, dtype
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.zeros(batch, 1, 1, cache.length, dtype=dtype, device=device)
        self.logits = None
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels (and cuBLAS workspaces) outside the capture
                self.logits = self._step()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()

    def _step(self) -> torch.Tensor:
        cos, sin = self.decoder.rotary_decode(self.positions, self.dtype)
        hidden = self.decoder.embed(self.tokens[:, None])
        hidden = self.decoder.forward(hidden, cos, sin, self.cache, self.slot, self.mask)
        return self.decoder.logits(hidden[:, -1])

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slot.fill_(slot)
        self.graph.replay()
        return self.logits


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, non-interleaved halves (megatron-core's _apply_rotary_pos_emb_bshd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _group_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """[B, 1, S, T] -> [B, 1, group*S, T]: every query head of a KV group sees the same keys."""
    if group == 1:
        return mask
    # queries are laid out group-major (g0: s0..sS-1, g1: s0..), so the rows repeat as a block
    return (
        mask.repeat(1, 1, group, 1)
        if mask.shape[2] > 1
        else mask.expand(mask.shape[0], 1, group, mask.shape[3])
    )


def _weights(layer) -> LayerWeights:
    attention, mlp = layer.self_attention, layer.mlp
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv_weight=attention.linear_qkv.weight,
        qkv_bias=attention.linear_qkv.bias,
        q_norm=_norm_weight(attention.q_layernorm),
        k_norm=_norm_weight(attention.k_layernorm),
        proj_weight=attention.linear_proj.weight,
        proj_bias=attention.linear_proj.bias,
        mlp_norm=layer.pre_mlp_layernorm.weight,
        fc1_weight=mlp.linear_fc1.weight,
        fc1_bias=mlp.linear_fc1.bias,
        fc2_weight=mlp.linear_fc2.weight,
        fc2_bias=mlp.linear_fc2.bias,
    )


def _norm_weight(norm) -> torch.Tensor | None:
    """The weight of megatron's optional q/k layernorm; None where the spec has none (Identity)."""
    return getattr(norm, "weight", None) if norm is not None else None
