"""The language model's forward for generation, written against the policy's own weight tensors.

Generation reads the Megatron policy's parameters in place (views, no copies: an optimizer step
is visible to the next rollout with no weight sync) and runs the transformer as plain tensor
ops, which is what makes the decode step fast and CUDA-graph capturable:

* prefill is *packed*: the unique prompts laid end to end, causal attention within each
  (rlflow/model/packed_attention.py), no compute on padding; each prompt's keys and values are
  then copied into the cache rows of all of its samples;
* keys are stored *rotated* in a static cache [rows, T, kv_heads, head_dim]: a decode step
  applies RoPE to the new token only, and each row attends to its own `lengths[row]` keys;
* on a GPU in bf16 the decode attention is FlashAttention's varlen kernel with `seqused_k`: it
  reads only the keys a row has, never the unwritten tail of the cache; a KV head's query group
  is laid out as that row's "query tokens", so each KV head is read once for all its queries;
  optionally, when few rows are live, each row's keys are split across several thread blocks
  (rlflow/generation/split_kv.py; off by default until measured on a GPU);
* elsewhere (CPU, fp32) it is SDPA with a length mask: exact, and the parity tests' reference.

Tensor parallelism: the policy's column/row-parallel weights are this rank's shards; the two
row-parallel outputs (attention projection, MLP down-projection) are all-reduced here.
The math mirrors megatron-core's local layer spec (RMSNorm, QKV with bias, SwiGLU MLP);
tests/generation compares it token for token with HF transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlflow.generation import split_kv
from rlflow.model.deepstack import DeepStack
from rlflow.model.packed_attention import Packing, flash_available, varlen_causal


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


@dataclass(frozen=True)
class Dims:
    heads: int  # query heads on this rank
    kv_heads: int
    head_dim: int
    eps: float
    scale: float
    tp_group: object | None

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


class KVCache:
    """Per-layer key/value buffers [rows, T, kv_heads, head_dim]; keys are stored rotated.

    Row r's keys live at slots 0..lengths[r]-1: its prompt, then its generated tokens.
    """

    def __init__(
        self, num_layers: int, rows: int, length: int, kv_heads: int, head_dim: int, dtype, device
    ):
        shape = (rows, length, kv_heads, head_dim)
        self.rows, self.length = rows, length
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def compact(self, order: torch.Tensor) -> None:
        """Rows order[0..n-1] move to the front (rows that finished make way for live ones)."""
        n = order.shape[0]
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[:n].copy_(buffer.index_select(0, order))


class Decoder:
    """Views of the policy's language-model weights plus the step functions that use them."""

    def __init__(self, core, *, compile_decode: bool):
        from rlflow.model.forward import language_model

        lm = language_model(core)
        config = lm.config
        attention = lm.decoder.layers[0].self_attention
        heads = attention.num_attention_heads_per_partition
        kv_heads = attention.num_query_groups_per_partition
        head_dim = attention.hidden_size_per_attention_head
        self.embedding = lm.embedding
        self.inv_freq = lm.rotary_pos_emb.inv_freq
        self.rotary_emb = lm.rotary_pos_emb
        self.mrope_section = getattr(lm, "mrope_section", None)
        self.final_norm = lm.decoder.final_layernorm.weight
        self.output_weight = (
            lm.shared_embedding_or_output_weight()
            if lm.share_embeddings_and_output_weights
            else lm.output_layer.weight
        )
        from megatron.core import parallel_state

        tp_group = None
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_group = tp_group
        self.layers = [_weights(layer) for layer in lm.decoder.layers]
        scale = config.softmax_scale or head_dim**-0.5
        self.dims = Dims(heads, kv_heads, head_dim, config.layernorm_epsilon, scale, tp_group)
        # Decode on GPUs: each layer's work before and after attention is fused by torch.compile
        # into a few kernels (norms, rotary, SwiGLU, residual adds); the cache write and the
        # attention call stay outside, since a compiled in-place write into the cache would copy
        # the whole cache. One graph serves every layer; the batch bucket changes as rows retire,
        # so after the second size dynamo compiles one shape-generic graph for all of them.
        # Under tensor parallelism the all-reduces stay eager (nothing is compiled).
        self._before, self._after = _before_attention, _after_attention
        self._merge = split_kv.merge
        if compile_decode and tp_group is None:
            self._before = torch.compile(_before_attention)
            self._after = torch.compile(_after_attention)
            self._merge = torch.compile(split_kv.merge)
        self.split_kv = False  # set by MegatronGeneration(split_kv=...)

    def new_cache(self, rows: int, length: int, dtype, device) -> KVCache:
        d = self.dims
        return KVCache(len(self.layers), rows, length, d.kv_heads, d.head_dim, dtype, device)

    # --- pieces ----------------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, S] -> [B, S, H] (megatron's vocab-parallel embedding does the TP reduction)."""
        return self.embedding(input_ids=tokens, position_ids=None).transpose(0, 1)

    def rotary(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, D] per token from positions [T], or an mrope family's 3-D [3, T]
        (through the model's own rotary module: sectioned or interleaved axes).

        Generated text tokens have equal positions on all three mrope axes, where mrope (either
        layout) equals plain RoPE: decode always passes [T]."""
        if positions.dim() == 2:
            freqs = self.rotary_emb(positions[:, None], self.mrope_section)  # [T, 1, 1, D]
            freqs = freqs[:, 0]
            return freqs.cos().to(dtype), freqs.sin().to(dtype)
        angles = positions[:, None].float() * self.inv_freq.float()  # [T, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [T, 1, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] -> fp32 logits [B, V] over the full vocabulary."""
        normed = F.rms_norm(hidden, hidden.shape[-1:], self.final_norm, self.dims.eps)
        logits = F.linear(normed, self.output_weight).float()
        if self.tp_group is not None:
            shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.tp_group))]
            dist.all_gather(shards, logits, group=self.tp_group)
            logits = torch.cat(shards, dim=-1)
        return logits

    # --- the transformer ------------------------------------------------------------------------

    def prefill(
        self, hidden: torch.Tensor, cos, sin, pack: Packing, cache: KVCache, dest: torch.Tensor,
        src: torch.Tensor, deepstack: DeepStack | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Packed prompts hidden [T, H] -> hidden [T, H] (before the final norm).

        Each layer's keys/values of token src[i] are written to flat cache slot dest[i]
        (row * cache.length + position): one prompt fills the rows of all of its samples.
        deepstack: vision features added to the first layers' outputs (Qwen3-VL), packed.
        """
        for index, w in enumerate(self.layers):
            keys = cache.keys[index].view(-1, self.dims.kv_heads, self.dims.head_dim)
            values = cache.values[index].view(-1, self.dims.kv_heads, self.dims.head_dim)
            hidden = prefill_layer(hidden, w, cos, sin, pack, keys, values, dest, src, self.dims)
            if deepstack is not None:
                hidden = deepstack.add(hidden, index)
        return hidden

    def decode(self, tokens, positions, lengths, cache: KVCache, rows: int) -> torch.Tensor:
        """One new token for each of the first `rows` cache rows -> fp32 logits [rows, V].

        tokens/positions/lengths [rows]: the token, its text position, and the row's key count
        including this token (it is written at slot lengths - 1).
        """
        cos, sin = self.rotary(positions, cache.keys[0].dtype)
        hidden = self.embed(tokens[:, None])[:, 0]
        slots = torch.arange(rows, device=tokens.device) * cache.length + lengths - 1
        split = self.split_plan(lengths, cache)
        for index, w in enumerate(self.layers):
            keys, values = cache.keys[index][:rows], cache.values[index][:rows]
            q, k, v = self._before(hidden, w, cos, sin, self.dims)
            out = _cache_attention(q, k, v, keys, values, slots, lengths, self.dims, split)
            hidden = self._after(hidden, out, w, self.dims)
        return self.logits(hidden)

    def split_plan(self, lengths: torch.Tensor, cache: KVCache) -> split_kv.SplitPlan | None:
        """How this step's flash decode splits each row's keys (None: one block per row)."""
        keys = cache.keys[0]
        if not (self.split_kv and flash_available(keys)):
            return None
        sms = torch.cuda.get_device_properties(keys.device).multi_processor_count
        splits = split_kv.num_splits(lengths.shape[0], self.dims.kv_heads, cache.length, sms)
        if splits == 1:
            return None
        plan = split_kv.plan(lengths, cache.length, self.dims.group, splits)
        return dataclasses.replace(plan, merge=self._merge)


def prefill_layer(hidden, w: LayerWeights, cos, sin, pack, keys, values, dest, src, dims: Dims):
    normed = F.rms_norm(hidden, hidden.shape[-1:], w.input_norm, dims.eps)
    q, k, v = _qkv(normed, w, cos, sin, dims)  # [T, heads or kv, D]
    keys.index_copy_(0, dest, k.index_select(0, src))
    values.index_copy_(0, dest, v.index_select(0, src))
    out = varlen_causal(q, k, v, pack, dims.scale).reshape(q.shape[0], -1)
    hidden = hidden + _reduce(F.linear(out, w.proj_weight), w.proj_bias, dims)
    return hidden + _mlp(hidden, w, dims)


def _before_attention(hidden, w: LayerWeights, cos, sin, dims: Dims):
    """hidden [rows, H] -> rotated q [rows, heads, D], k and v [rows, kv, D]."""
    normed = F.rms_norm(hidden, hidden.shape[-1:], w.input_norm, dims.eps)
    return _qkv(normed, w, cos, sin, dims)


def _cache_attention(q, k, v, keys, values, slots, lengths, dims: Dims, split=None):
    """Write the new keys/values at `slots` of keys/values [rows, T, kv, D]; attend over each
    row's first lengths[row] keys -> [rows, heads*D]."""
    rows, length = keys.shape[0], keys.shape[1]
    flat_keys = keys.view(rows * length, dims.kv_heads, dims.head_dim)
    flat_values = values.view(rows * length, dims.kv_heads, dims.head_dim)
    flat_keys.index_copy_(0, slots, k)
    flat_values.index_copy_(0, slots, v)
    return _decode_attention(q, keys, values, flat_keys, flat_values, lengths, dims, split)


def _after_attention(hidden, out, w: LayerWeights, dims: Dims):
    """Attention projection + residual, then the MLP block + residual."""
    hidden = hidden + _reduce(F.linear(out, w.proj_weight), w.proj_bias, dims)
    return hidden + _mlp(hidden, w, dims)


def _qkv(x, w: LayerWeights, cos, sin, dims: Dims):
    """x [N, H] -> rotated q [N, heads, D] and k [N, kv, D], v [N, kv, D]."""
    n = x.shape[0]
    qkv = F.linear(x, w.qkv_weight, w.qkv_bias)
    # megatron's fused QKV layout per query group: [q_1..q_group, k, v] x head_dim
    qkv = qkv.view(n, dims.kv_heads, dims.group + 2, dims.head_dim)
    q = qkv[:, :, : dims.group].reshape(n, dims.heads, dims.head_dim)
    k, v = qkv[:, :, dims.group], qkv[:, :, dims.group + 1]
    if w.q_norm is not None:
        q = F.rms_norm(q, q.shape[-1:], w.q_norm, dims.eps)
        k = F.rms_norm(k, k.shape[-1:], w.k_norm, dims.eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v.contiguous()


def _decode_attention(q, keys, values, flat_keys, flat_values, lengths, dims: Dims, split=None):
    """q [rows, heads, D] against each row's first lengths[row] cached keys -> [rows, heads*D].

    split: a split_kv.SplitPlan for this step (flash only), or None."""
    rows, length = keys.shape[0], keys.shape[1]
    group = dims.group
    if flash_available(q):
        # Grouped-query layout: per row, the `group` query heads of a KV head are `group` query
        # "tokens" of a sequence with kv_heads heads, so each KV head is read once for all of them.
        q_tokens = q.view(rows, dims.kv_heads, group, dims.head_dim).transpose(1, 2)
        q_tokens = q_tokens.reshape(rows * group, dims.kv_heads, dims.head_dim)
        if split is not None:
            out = split_kv.attention(q_tokens, flat_keys, flat_values, split, rows,
                                     _flash_attend(dims.scale))  # fmt: skip
        else:
            cu_q = torch.arange(0, rows + 1, device=q.device, dtype=torch.int32) * group
            cu_k = torch.arange(0, rows + 1, device=q.device, dtype=torch.int32) * length
            out = _flash_attend(dims.scale)(
                q_tokens, flat_keys, flat_values, cu_q, cu_k, group, length, lengths
            )[0]
        out = out.view(rows, group, dims.kv_heads, dims.head_dim).transpose(1, 2)
        return out.reshape(rows, dims.heads * dims.head_dim)
    allowed = torch.arange(length, device=q.device)[None] < lengths[:, None]  # [rows, T]
    out = F.scaled_dot_product_attention(
        q.view(rows, dims.kv_heads, group, dims.head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=allowed[:, None, None, :],
        scale=dims.scale,
    )
    return out.reshape(rows, dims.heads * dims.head_dim)


def _flash_attend(scale: float):
    """FlashAttention varlen, non-causal, reading only `used` keys of each sequence."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, used):
        out, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False,
            scale=scale, seqused_k=used.to(torch.int32),
        )[:2]  # fmt: skip
        return out, lse

    return attend


def _mlp(hidden, w: LayerWeights, dims: Dims):
    normed = F.rms_norm(hidden, hidden.shape[-1:], w.mlp_norm, dims.eps)
    gate, up = F.linear(normed, w.fc1_weight, w.fc1_bias).chunk(2, dim=-1)
    return _reduce(F.linear(F.silu(gate) * up, w.fc2_weight), w.fc2_bias, dims)


def _reduce(x: torch.Tensor, bias: torch.Tensor | None, dims: Dims) -> torch.Tensor:
    """Row-parallel output: sum the tensor-parallel partial results, then add the bias."""
    if dims.tp_group is not None:
        dist.all_reduce(x, group=dims.tp_group)
    return x if bias is None else x + bias


class DecodeGraph:
    """The decode step for the first `rows` cache rows, captured once as a CUDA graph."""

    def __init__(self, decoder: Decoder, cache: KVCache, rows: int, pool):
        device = cache.keys[0].device
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        # Warm-up runs really execute: point their writes at the cache's last slot, a scratch
        # slot no row ever reaches (the engine sizes the cache one past the longest row).
        self.lengths = torch.full((rows,), cache.length, dtype=torch.long, device=device)

        def step():
            return decoder.decode(self.tokens, self.positions, self.lengths, cache, rows)

        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels (and cuBLAS workspaces) outside the capture
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = step()

    def run(self, tokens, positions, lengths) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.lengths.copy_(lengths)
        self.graph.replay()
        return self.logits


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, non-interleaved halves (megatron-core's _apply_rotary_pos_emb_bshd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


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
