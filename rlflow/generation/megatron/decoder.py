"""The language model's forward for generation, written against the policy's own weight tensors.

Generation reads the Megatron policy's parameters in place (views, no copies: an optimizer step
is visible to the next rollout with no weight sync) and runs the transformer as plain tensor
ops, which is what makes the decode step fast and CUDA-graph capturable:

* prefill is *packed*: the unique prompts laid end to end, causal attention within each
  (rlflow/model/packed_attention.py), no compute on padding; each prompt's keys and values are
  then copied into the cache rows of all of its samples;
* keys are stored *rotated* in a paged cache (blocks of 64 tokens handed to rows as they
  grow: rlflow/generation/megatron/kv_cache.py): a decode step applies RoPE to the new token only, and
  each row attends to its own `lengths[row]` keys through its block table;
* on a GPU in bf16 a decode step's attention is one Triton kernel per layer
  (rlflow/generation/megatron/flash_decode.py): it takes the fused QKV projection as it comes, applies the
  q/k norm and RoPE, writes the new key and value into the cache, and attends over each row's
  own `lengths[row]` keys, split across thread blocks when few rows are live; the rest of a
  layer (output projection, MLP, residuals) and the next layer's norm and QKV projection are one
  torch.compile'd function, so a layer is ~8 kernels;
* elsewhere (CPU, fp32) it is SDPA with a length mask: exact, and the parity tests' reference;
* with `fp8`, the decode step's layer matmuls run in FP8 (rlflow/generation/megatron/fp8.py); prefill
  and the output head stay in the policy's dtype.

Tensor parallelism: the policy's column/row-parallel weights are this rank's shards; the two
row-parallel outputs (attention projection, MLP down-projection) are all-reduced here.
The math mirrors megatron-core's local layer spec (RMSNorm, QKV with bias, SwiGLU MLP);
tests/generation compares it token for token with HF transformers. Mixture-of-experts layers
run rlflow/generation/megatron/moe_decode.py's routed experts instead of the MLP and report each token's
chosen experts into a `routing` buffer [tokens, layers, k] (router replay); dense layers take
exactly the code path they always took.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlflow.generation.megatron import flash_decode, fp8
from rlflow.generation.megatron.kv_cache import KVCache
from rlflow.generation.megatron.moe_decode import MoEWeights, moe_mlp, moe_weights
from rlflow.model.families.qwen3vl.deepstack import DeepStack
from rlflow.model.packed_attention import Packing, varlen_causal


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
    fc1_weight: torch.Tensor | None  # None in an MoE layer (its experts are in `moe`)
    fc1_bias: torch.Tensor | None
    fc2_weight: torch.Tensor | None
    fc2_bias: torch.Tensor | None
    quantized: fp8.LayerFP8 | None = None  # FP8 copies of the four matmul weights (decode only)
    moe: MoEWeights | None = None  # routed experts (rlflow/generation/megatron/moe_decode.py)


@dataclass(frozen=True)
class Dims:
    heads: int  # query heads on this rank
    kv_heads: int
    head_dim: int
    eps: float
    scale: float
    tp_group: object | None
    # tensor-parallel ranks that share one KV head (megatron-core with TP above the KV heads:
    # each rank's QKV projection is a contiguous slice of the fused output, gathered and cut
    # to its query heads and their group's key/value, `_gather_kv`); 1: none
    kv_split: int = 1

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


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
        if tp_group is not None and (config.num_query_groups or heads) < dist.get_world_size(
            tp_group
        ):
            raise ValueError(
                "the engine's GPT decoder splits whole KV heads over the tensor-parallel ranks: "
                f"tensor_parallel_size {dist.get_world_size(tp_group)} exceeds the model's "
                f"{config.num_query_groups} KV heads (rlflow/rules/elsewhere.py refuses it)"
            )
        self.layers = [_weights(layer) for layer in lm.decoder.layers]
        moe = next((w.moe for w in self.layers if w.moe is not None), None)
        self.topk = moe.topk if moe is not None else 0  # experts per token; 0: a dense model
        scale = config.softmax_scale or head_dim**-0.5
        self.dims = Dims(heads, kv_heads, head_dim, config.layernorm_epsilon, scale, tp_group)
        # Decode on GPUs: between two attention calls, the output projection, the MLP, the
        # residual adds and the next layer's norm and QKV projection are one torch.compile'd
        # function (`_between`: norms, SwiGLU and residuals fuse into the GEMMs' neighbours);
        # the attention (rotary, cache write, attention: flash_decode.py) stays outside, since a
        # compiled in-place write into the cache would copy the whole cache. One graph serves
        # every layer; the batch bucket changes as rows retire, so after the second size dynamo
        # compiles one shape-generic graph for all of them. Under tensor parallelism the
        # all-reduces stay eager (nothing is compiled).
        self._first, self._between = _first_qkv, _between_attention
        if compile_decode and tp_group is None:
            self._first = torch.compile(_first_qkv)
            self._between = torch.compile(_between_attention)
        self.fp8 = False  # set_fp8: the decode step's layer matmuls in FP8
        self._decode_layers = self.layers
        self._sms = 0

    @property
    def moe_layers(self) -> list[MoEWeights | None]:
        """Each layer's routed experts (None: a dense layer), in the order of the trainer's
        router layer numbers (router replay's `routing` [..., layers, k])."""
        return [w.moe for w in self.layers]

    def set_fp8(self, enabled: bool) -> None:
        """Decode through FP8 copies of the layer weights (quantized now; `requantize` after
        every weight update), or through the policy's own tensors."""
        if enabled and self.topk:
            raise ValueError(
                "FP8 decode of mixture-of-experts layers is not implemented: set "
                "generation.fp8 to false for an MoE model"
            )
        self.fp8 = enabled
        self._decode_layers = self.layers
        if enabled:
            self._decode_layers = [
                dataclasses.replace(w, quantized=fp8.quantize_layer(w)) for w in self.layers
            ]

    def requantize(self) -> None:
        """Refresh the FP8 copies from the policy's current weights, in place (CUDA graphs keep
        pointing at the same buffers)."""
        for w in self._decode_layers:
            if w.quantized is not None:
                fp8.requantize_layer_(w.quantized, w)

    def new_cache(self, *, blocks: int, rows: int, max_len: int, dtype, device) -> KVCache:
        d = self.dims
        return KVCache(
            len(self.layers), blocks=blocks, rows=rows, max_len=max_len, kv_heads=d.kv_heads,
            head_dim=d.head_dim, dtype=dtype, device=device,
        )  # fmt: skip

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
        src: torch.Tensor, routing: torch.Tensor | None = None, *,
        deepstack: DeepStack | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Packed prompts hidden [T, H] -> hidden [T, H] (before the final norm).

        Each layer's keys/values of token src[i] are written to flat cache slot dest[i]
        (KVCache.slots: a block of the row's table, a slot in it): one prompt fills the rows of
        all of its samples.
        routing [T, layers, k]: receives each token's experts (MoE models).
        deepstack: vision features added to the first layers' outputs (Qwen3-VL), packed.
        """
        for index, w in enumerate(self.layers):
            keys = cache.keys[index].view(-1, self.dims.kv_heads, self.dims.head_dim)
            values = cache.values[index].view(-1, self.dims.kv_heads, self.dims.head_dim)
            if w.moe is None:
                hidden = prefill_layer(
                    hidden, w, cos, sin, pack, keys, values, dest, src, self.dims
                )
            else:
                hidden = _prefill_attention(
                    hidden, w, cos, sin, pack, keys, values, dest, src, self.dims
                )
                hidden = self._routed(hidden, w, routing, index)
            if deepstack is not None:
                hidden = deepstack.add(hidden, index)
        return hidden

    def _routed(self, hidden, w: LayerWeights, routing, index: int) -> torch.Tensor:
        """The MoE block + residual; the chosen experts go to routing[:, index]."""
        out, chosen = moe_mlp(hidden, w.moe, self.dims.eps)
        if routing is not None:
            routing[:, index] = chosen
        return hidden + _reduce(out, None, self.dims)

    def decode(
        self, tokens, positions, lengths, cache: KVCache, rows: int, routing=None
    ) -> torch.Tensor:
        """One new token for each of the first `rows` cache rows -> fp32 logits [rows, V].

        tokens/positions/lengths [rows]: the token, its text position, and the row's key count
        including this token (it is written at slot lengths - 1). routing [rows, layers, k]:
        receives each row's experts (MoE models).
        """
        cos, sin = self.rotary(positions, cache.keys[0].dtype)
        hidden = self.embed(tokens[:, None])[:, 0]
        layers = self._decode_layers
        qkv = self._first(hidden, layers[0], self.dims)
        fused = flash_decode.available(qkv, self.dims.head_dim)
        splits = self._splits(rows) if fused else 1
        table = cache.table[:rows]
        for index, w in enumerate(layers):
            keys, values = cache.keys[index], cache.values[index]
            if fused:
                out = flash_decode.attention(
                    qkv, cos[:, 0], sin[:, 0], keys, values, table, lengths,
                    group=self.dims.group, scale=self.dims.scale, splits=splits,
                    q_norm=w.q_norm, k_norm=w.k_norm, eps=self.dims.eps,
                )  # fmt: skip
            else:
                out = _reference_attention(qkv, w, cos, sin, keys, values, table, lengths,
                                           self.dims)  # fmt: skip
            following = layers[index + 1] if index + 1 < len(layers) else None
            if w.moe is None:
                hidden, qkv = self._between(hidden, out, w, following, self.dims)
                continue
            hidden = hidden + _reduce(F.linear(out, w.proj_weight), w.proj_bias, self.dims)
            hidden = self._routed(hidden, w, routing, index)
            qkv = None if following is None else self._first(hidden, following, self.dims)
        return self.logits(hidden)

    def _splits(self, rows: int) -> int:
        if not self._sms:
            device = self.output_weight.device
            self._sms = torch.cuda.get_device_properties(device).multi_processor_count
        return flash_decode.num_splits(rows, self.dims.kv_heads, self._sms)


def prefill_layer(hidden, w: LayerWeights, cos, sin, pack, keys, values, dest, src, dims: Dims):
    hidden = _prefill_attention(hidden, w, cos, sin, pack, keys, values, dest, src, dims)
    return hidden + _mlp(hidden, w, dims)


def _prefill_attention(hidden, w: LayerWeights, cos, sin, pack, keys, values, dest, src, dims):
    """The attention block + residual of a packed prefill (writing the cache)."""
    normed = F.rms_norm(hidden, hidden.shape[-1:], w.input_norm, dims.eps)
    q, k, v = _qkv(normed, w, cos, sin, dims)  # [T, heads or kv, D]
    keys.index_copy_(0, dest, k.index_select(0, src))
    values.index_copy_(0, dest, v.index_select(0, src))
    out = varlen_causal(q, k, v, pack, dims.scale).reshape(q.shape[0], -1)
    return hidden + _reduce(F.linear(out, w.proj_weight), w.proj_bias, dims)


def _first_qkv(hidden, w: LayerWeights, dims: Dims):
    """The first layer's input norm and QKV projection: hidden [rows, H] -> qkv [rows, ...]."""
    normed = F.rms_norm(hidden, hidden.shape[-1:], w.input_norm, dims.eps)
    return _linear(normed, w.qkv_weight, w.qkv_bias, w.quantized and w.quantized.qkv)


def _between_attention(hidden, out, w: LayerWeights, following: LayerWeights | None, dims: Dims):
    """Layer w after its attention (projection, MLP, residuals), then the following layer's
    input norm and QKV projection -> (hidden [rows, H], qkv [rows, ...] or None)."""
    hidden = _after_attention(hidden, out, w, dims)
    return hidden, None if following is None else _first_qkv(hidden, following, dims)


def _reference_attention(qkv, w: LayerWeights, cos, sin, keys, values, table, lengths, dims):
    """The exact path (CPU, fp32): split and rotate the projection, write the new keys/values
    at token lengths - 1 of each row's blocks (pools [blocks, BLOCK, kv, D], block table
    [rows, max_blocks]: rlflow/generation/megatron/kv_cache.py), gather each row's blocks and attend
    over its first lengths[row] keys with a length-masked SDPA -> [rows, heads*D]."""
    q, k, v = _split_qkv(qkv, w, cos, sin, dims)
    rows, block = qkv.shape[0], keys.shape[1]
    new = lengths - 1
    rows_index = torch.arange(rows, device=q.device)
    slots = table[rows_index, new // block].long() * block + new % block
    flat = (-1, dims.kv_heads, dims.head_dim)
    keys.view(flat).index_copy_(0, slots, k)
    values.view(flat).index_copy_(0, slots, v)
    span = table.shape[1] * block
    row_keys = keys[table.long()].view(rows, span, *flat[1:])  # [rows, span, kv, D]
    row_values = values[table.long()].view(rows, span, *flat[1:])
    allowed = torch.arange(span, device=q.device)[None] < lengths[:, None]  # [rows, span]
    out = F.scaled_dot_product_attention(
        q.view(rows, dims.kv_heads, dims.group, dims.head_dim),
        row_keys.transpose(1, 2),
        row_values.transpose(1, 2),
        attn_mask=allowed[:, None, None, :],
        scale=dims.scale,
    )
    return out.reshape(rows, dims.heads * dims.head_dim)


def _after_attention(hidden, out, w: LayerWeights, dims: Dims):
    """Attention projection + residual, then the MLP block + residual."""
    q = w.quantized
    hidden = hidden + _reduce(_linear(out, w.proj_weight, None, q and q.proj), w.proj_bias, dims)
    return hidden + _mlp(hidden, w, dims)


def _linear(x, weight, bias, quantized: fp8.QuantizedWeight | None):
    """x @ weight.T + bias, through the FP8 copy of the weight when there is one."""
    if quantized is None:
        return F.linear(x, weight, bias)
    return fp8.linear(x, quantized, bias)


def _qkv(x, w: LayerWeights, cos, sin, dims: Dims):
    """x [N, H] -> rotated q [N, heads, D] and k [N, kv, D], v [N, kv, D]."""
    return _split_qkv(_gather_kv(F.linear(x, w.qkv_weight, w.qkv_bias), dims), w, cos, sin, dims)


def _gather_kv(qkv: torch.Tensor, dims: Dims) -> torch.Tensor:
    """This rank's fused [q_1..q_group, k, v] x head_dim when the tensor-parallel size exceeds
    the KV heads (dims.kv_split ranks share each KV head), as megatron-core's attention does it:
    every rank's projection is a contiguous slice of the whole fused output, so gather the
    slices, take this rank's query group (whole: its q heads, k, v), then its share of the
    group's q heads. [N, P] -> [N, (heads + 2) * D] (one KV head); unchanged when kv_split is 1."""
    if dims.kv_split == 1:
        return qkv
    group = dist.get_world_size(dims.tp_group)
    shards = [torch.empty_like(qkv) for _ in range(group)]
    dist.all_gather(shards, qkv.contiguous(), group=dims.tp_group)
    whole = torch.cat(shards, dim=-1)
    rank = dist.get_rank(dims.tp_group)
    groups = group // dims.kv_split  # the model's KV heads
    per_group = whole.shape[-1] // groups // dims.head_dim - 2  # q heads of one KV head
    mine = whole.view(qkv.shape[0], groups, per_group + 2, dims.head_dim)[:, rank // dims.kv_split]
    first = (rank % dims.kv_split) * dims.heads
    q = mine[:, first : first + dims.heads]
    return torch.cat((q, mine[:, per_group:]), dim=1).reshape(qkv.shape[0], -1)


def _split_qkv(qkv, w: LayerWeights, cos, sin, dims: Dims):
    """The fused projection [N, kv * (group + 2) * D] -> rotated q, k and v."""
    n = qkv.shape[0]
    # megatron's fused QKV layout per query group: [q_1..q_group, k, v] x head_dim
    qkv = qkv.view(n, dims.kv_heads, dims.group + 2, dims.head_dim)
    q = qkv[:, :, : dims.group].reshape(n, dims.heads, dims.head_dim)
    k, v = qkv[:, :, dims.group], qkv[:, :, dims.group + 1]
    if w.q_norm is not None:
        q = F.rms_norm(q, q.shape[-1:], w.q_norm, dims.eps)
        k = F.rms_norm(k, k.shape[-1:], w.k_norm, dims.eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v.contiguous()


def _mlp(hidden, w: LayerWeights, dims: Dims):
    normed = F.rms_norm(hidden, hidden.shape[-1:], w.mlp_norm, dims.eps)
    q = w.quantized
    gate, up = _linear(normed, w.fc1_weight, w.fc1_bias, q and q.fc1).chunk(2, dim=-1)
    return _reduce(_linear(F.silu(gate) * up, w.fc2_weight, None, q and q.fc2), w.fc2_bias, dims)


def _reduce(x: torch.Tensor, bias: torch.Tensor | None, dims: Dims) -> torch.Tensor:
    """Row-parallel output: sum the tensor-parallel partial results, then add the bias."""
    if dims.tp_group is not None:
        dist.all_reduce(x, group=dims.tp_group)
    return x if bias is None else x + bias


class DecodeGraph:
    """The decode step for the first `rows` cache rows, captured once as a CUDA graph."""

    def __init__(self, decoder: Decoder, cache: KVCache, rows: int, pool, routing=None):
        device = cache.keys[0].device
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        # Warm-up runs really execute: point their writes at the cache's last slot, a scratch
        # slot no row ever reaches (the engine sizes the cache one past the longest row).
        self.lengths = torch.full((rows,), cache.length, dtype=torch.long, device=device)

        def step():  # routing: the engine's static buffer, written by every replay
            return decoder.decode(self.tokens, self.positions, self.lengths, cache, rows, routing)

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
    moe = moe_weights(layer)
    dense = moe is None
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv_weight=attention.linear_qkv.weight,
        qkv_bias=attention.linear_qkv.bias,
        q_norm=_norm_weight(attention.q_layernorm),
        k_norm=_norm_weight(attention.k_layernorm),
        proj_weight=attention.linear_proj.weight,
        proj_bias=attention.linear_proj.bias,
        mlp_norm=layer.pre_mlp_layernorm.weight,
        fc1_weight=mlp.linear_fc1.weight if dense else None,
        fc1_bias=mlp.linear_fc1.bias if dense else None,
        fc2_weight=mlp.linear_fc2.weight if dense else None,
        fc2_bias=mlp.linear_fc2.bias if dense else None,
        moe=moe,
    )


def _norm_weight(norm) -> torch.Tensor | None:
    """The weight of megatron's optional q/k layernorm; None where the spec has none (Identity)."""
    return getattr(norm, "weight", None) if norm is not None else None
