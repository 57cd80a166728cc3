"""Multimodal generation straight from the Megatron policy: batched prefill, KV-cached decode.

The trainer's own weights generate the rollouts (no copy, no weight sync). megatron-core 0.19.2's
engines do not fit here (the dynamic engine needs flash-attn; the legacy static engine is batch-1
for VLMs, re-applies RoPE to the whole cache and expands GQA heads every step), so this module
drives the policy's modules itself:

* prefill: one forward over the left-padded prompt batch with vision features scattered at the
  pad tokens and Qwen2.5-VL's 3-D rotary positions (padding-aware), filling the cache;
* decode: one token per row per step; keys are stored *rotated* so a step touches only the new
  token's rotary; attention is PyTorch SDPA with grouped KV heads (no head expansion);
* each layer reuses megatron-core's own norms and linear layers (so tensor parallelism works
  unchanged: column/row-parallel linears do their own communication).

`Decoder` holds the per-layer step; `MegatronGeneration` adds batching, sampling and stopping.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from rlflow.generation.base import Completion, GenerationBackend, Prompt, SamplingParams
from rlflow.generation.placeholders import expanded_token_ids
from rlflow.generation.sampling import sample_tokens
from rlflow.model.forward import Media, embed, mrope_positions


class KVCache:
    """Static per-layer key/value buffers [B, kv_heads, T, head_dim]; keys stored rotated."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        end = start + keys.shape[2]
        self.keys[layer][:, :, start:end] = keys
        self.values[layer][:, :, start:end] = values


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, non-interleaved (megatron-core's _apply_rotary_pos_emb_bshd with mscale 1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Decoder:
    """One transformer pass over new tokens, reading and extending a KV cache."""

    def __init__(self, core):
        self.core = core
        self.lm = core.language_model
        self.layers = list(self.lm.decoder.layers)
        attention = self.layers[0].self_attention
        self.heads = attention.num_attention_heads_per_partition
        self.kv_heads = attention.num_query_groups_per_partition
        self.head_dim = attention.hidden_size_per_attention_head

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, S, D] from 3-D positions [3, B, S]; computed once per step for all layers."""
        freqs = self.lm.rotary_pos_emb(positions, self.lm.mrope_section)  # [S, B, 1, D]
        freqs = freqs.permute(1, 2, 0, 3)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def forward(self, hidden: torch.Tensor, cos, sin, cache: KVCache, start: int,
                attend: torch.Tensor) -> torch.Tensor:
        """hidden [S, B, H] of tokens at cache slots start..start+S -> final hidden [S, B, H].

        attend: bool [B, 1, S, start+S], True where a query may look at a key.
        """
        end = start + hidden.shape[0]
        for index, layer in enumerate(self.layers):
            attention = layer.self_attention
            normed = layer.input_layernorm(hidden)
            query, key, value = attention.get_query_key_value_tensors(normed, None)
            # [S, B, heads, D] -> [B, heads, S, D]
            query = rotate(query.permute(1, 2, 0, 3), cos, sin)
            key = rotate(key.permute(1, 2, 0, 3), cos, sin)
            cache.write(index, start, key, value.permute(1, 2, 0, 3))
            context = F.scaled_dot_product_attention(
                query, cache.keys[index][:, :, :end], cache.values[index][:, :, :end],
                attn_mask=attend, enable_gqa=self.heads != self.kv_heads)
            context = context.permute(2, 0, 1, 3).reshape(hidden.shape[0], hidden.shape[1], -1)
            out, bias = attention.linear_proj(context)
            hidden = hidden + (out if bias is None else out + bias)
            out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden))
            hidden = hidden + (out if bias is None else out + bias)
        return self.lm.decoder.final_layernorm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits [B, V] for the last position of hidden [S, B, H]."""
        weight = self.lm.shared_embedding_or_output_weight() if self.lm.share_embeddings_and_output_weights else None
        logits, _ = self.lm.output_layer(hidden[-1:], weight=weight, runtime_gather_output=True)
        return logits[0].float()


class MegatronGeneration(GenerationBackend):
    """Rollouts from the policy's own Megatron modules (weights shared with training)."""

    name = "megatron"

    def __init__(self, policy, pad_token_id: int, max_batch_size: int):
        if policy.extra.get("pipeline_parallel_size", 1) > 1:
            raise ValueError("megatron generation needs pipeline_parallel_size=1")
        self.policy = policy
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.last_timings: dict[str, float] = {}

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Completion]:
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = prompts[start:start + self.max_batch_size]
            out += self._generate_batch(chunk, params, seed=params.seed + start)
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts: list[Prompt], params: SamplingParams, seed: int) -> list[Completion]:
        core = self.policy.core
        was_training = core.training
        core.eval()
        try:
            return self._run(core, prompts, params, seed)
        finally:
            core.train(was_training)

    def _run(self, core, prompts, params, seed) -> list[Completion]:
        device = next(core.parameters()).device
        dtype = self.policy.dtype
        merge = core.config.vision_config.spatial_merge_size
        rows = [expanded_token_ids(p, core.config.image_token_id, core.config.video_token_id, merge)
                for p in prompts]
        input_ids, valid = _left_pad(rows, self.pad_token_id, device)
        media = Media.concat([p.media for p in prompts]).to(device)
        batch, prompt_len = input_ids.shape
        decoder = Decoder(core)
        cache = KVCache(len(decoder.layers), batch, decoder.kv_heads, prompt_len + params.max_new_tokens,
                        decoder.head_dim, dtype, device)
        generator = torch.Generator(device=device).manual_seed(seed)

        t0 = time.perf_counter()
        positions, _ = mrope_positions(core, input_ids, valid, media)
        cos, sin = decoder.rotary(positions, dtype)
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
        attend = causal[None, None] & valid[:, None, None, :]
        # A fully padded query row would attend to nothing (NaN in SDPA): let it see itself.
        attend = attend | torch.eye(prompt_len, dtype=torch.bool, device=device)[None, None]
        hidden = decoder.forward(embed(core, input_ids, media), cos, sin, cache, 0, attend)
        logits = decoder.logits(hidden)
        _sync(device)
        t_prefill = time.perf_counter() - t0

        next_position = positions.amax(dim=(0, 2)) + 1  # [B]: text continues after the prompt
        key_valid = torch.cat([valid, torch.ones(batch, params.max_new_tokens, dtype=torch.bool,
                                                 device=device)], dim=1)
        tokens = torch.empty(batch, params.max_new_tokens, dtype=torch.long, device=device)
        logprobs = torch.empty(batch, params.max_new_tokens, dtype=torch.float32, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        stop_ids = torch.tensor(params.stop_token_ids or [-1], device=device)
        steps = 0
        for step in range(params.max_new_tokens):
            token = sample_tokens(logits, params, generator)
            tokens[:, step] = token
            logprobs[:, step] = torch.log_softmax(logits, -1).gather(1, token[:, None])[:, 0]
            steps = step + 1
            if not params.ignore_eos:
                finished |= torch.isin(token, stop_ids)
                if bool(finished.all()):
                    break
            if step + 1 == params.max_new_tokens:
                break
            slot = prompt_len + step
            pos = (next_position + step).view(1, batch, 1).expand(3, batch, 1)
            cos, sin = decoder.rotary(pos, dtype)
            attend = key_valid[:, None, None, : slot + 1]
            embedding = core.language_model.embedding(input_ids=token[:, None], position_ids=None)
            hidden = decoder.forward(embedding, cos, sin, cache, slot, attend)
            logits = decoder.logits(hidden)
        _sync(device)
        total = time.perf_counter() - t0
        self.last_timings = {"prefill_s": t_prefill, "total_s": total, "steps": steps,
                             "decode_ms_per_step": 1e3 * (total - t_prefill) / max(steps - 1, 1)}
        return _completions(tokens[:, :steps].tolist(), logprobs[:, :steps].tolist(), params)


def _left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        valid[i, width - len(row):] = True
    return ids.to(device), valid.to(device)


def _completions(tokens: list[list[int]], logprobs: list[list[float]],
                 params: SamplingParams) -> list[Completion]:
    out = []
    stops = set(params.stop_token_ids)
    for row_tokens, row_logprobs in zip(tokens, logprobs):
        end = len(row_tokens)
        reason = "length"
        if not params.ignore_eos:
            for i, tok in enumerate(row_tokens):
                if tok in stops:
                    end, reason = i + 1, "stop"
                    break
        out.append(Completion(token_ids=row_tokens[:end], logprobs=row_logprobs[:end],
                              finish_reason=reason))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

