"""Multimodal generation straight from the Megatron policy: batched prefill, KV-cached decode.

The trainer's own weights generate the rollouts (no copy, no weight sync). megatron-core 0.19.2's
engines do not fit here: the dynamic engine needs flash-attn; the legacy static engine is batch-1
for VLMs, re-applies RoPE to the whole cache and expands GQA heads every step. So rlflow drives
the policy itself:

1. prefill: vision features scattered at the image/video pad tokens (`embed`), Qwen2.5-VL's 3-D
   rotary positions computed with the padding mask, one pass over the left-padded prompt batch
   that fills the KV cache (`Decoder.forward`);
2. decode: one token per row per step; on a GPU the step is a replayed CUDA graph;
3. sampling: greedy or temperature/top-p/top-k with a seeded generator; rows stop at EOS or
   max_new_tokens independently; logprobs are of the unmodified distribution.
"""

from __future__ import annotations

import time

import torch

from rlflow.generation.base import Completion, GenerationBackend, Prompt, SamplingParams
from rlflow.generation.decoder import DecodeGraph, Decoder, KVCache
from rlflow.generation.placeholders import expanded_token_ids
from rlflow.generation.sampling import sample_tokens
from rlflow.model.forward import Media, embed, is_multimodal, mrope_positions

# Check "has every row stopped?" every few steps: each check is a device->host sync.
_STOP_CHECK_EVERY = 8


class MegatronGeneration(GenerationBackend):
    """Rollouts from the policy's own Megatron modules (weights shared with training)."""

    name = "megatron"

    def __init__(
        self,
        policy,
        pad_token_id: int,
        max_batch_size: int,
        cuda_graphs: bool = True,
        compile_decode: bool = False,
    ):
        self.policy = policy
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        device = next(policy.core.parameters()).device
        self.cuda_graphs = cuda_graphs and device.type == "cuda"  # graphs exist on GPUs only
        self.compile_decode = compile_decode
        self._decoder: Decoder | None = None
        self._graphs: dict[tuple[int, int], tuple[KVCache, DecodeGraph]] = {}
        self.last_timings: dict[str, float] = {}

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Completion]:
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = prompts[start : start + self.max_batch_size]
            out += self._generate_batch(chunk, params, seed=params.seed + start)
        return out

    def close(self) -> None:
        self._graphs.clear()

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[Prompt], params: SamplingParams, seed: int
    ) -> list[Completion]:
        core = self.policy.core
        was_training = core.training
        core.eval()
        try:
            return self._run(core, prompts, params, seed)
        finally:
            core.train(was_training)

    def _cache(
        self, decoder: Decoder, batch: int, length: int, device
    ) -> tuple[KVCache, DecodeGraph | None]:
        """A KV cache (and its captured decode graph), reused across calls of the same shape."""
        if not self.cuda_graphs:
            return KVCache(
                len(decoder.layers),
                batch,
                decoder.kv_heads,
                length,
                decoder.head_dim,
                self.policy.dtype,
                device,
            ), None
        # Round the cache length up so a few graphs serve every prompt length (memory stays flat).
        length = -(-length // 64) * 64
        key = (batch, length)
        if key not in self._graphs:
            cache = KVCache(
                len(decoder.layers),
                batch,
                decoder.kv_heads,
                length,
                decoder.head_dim,
                self.policy.dtype,
                device,
            )
            self._graphs[key] = (cache, DecodeGraph(decoder, cache, self.policy.dtype))
        return self._graphs[key]

    def _run(self, core, prompts, params, seed) -> list[Completion]:
        device = next(core.parameters()).device
        dtype = self.policy.dtype
        tokens_of = self.policy.media_tokens
        rows = [
            expanded_token_ids(p, tokens_of.image, tokens_of.video, tokens_of.merge_size)
            for p in prompts
        ]
        input_ids, valid = _left_pad(rows, self.pad_token_id, device)
        media = Media.concat([p.media for p in prompts]).to(device)
        batch, prompt_len = input_ids.shape
        if self._decoder is None:  # views of the weights: built once, current after every update
            self._decoder = Decoder(core, compile_decode=self.compile_decode)
        decoder = self._decoder
        cache, graph = self._cache(decoder, batch, prompt_len + params.max_new_tokens, device)
        generator = torch.Generator(device=device).manual_seed(seed)

        t0 = time.perf_counter()
        if is_multimodal(core):
            positions, _ = mrope_positions(core, input_ids, valid, media)
            embeddings = embed(core, input_ids, media).transpose(0, 1)
        else:  # text-only: positions count the row's own tokens (left padding is skipped)
            positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
            embeddings = decoder.embed(input_ids)
        cos, sin = decoder.rotary_prefill(positions, dtype)
        hidden = decoder.forward(embeddings, cos, sin, cache, 0, _prefill_mask(valid, dtype))
        logits = decoder.logits(hidden[:, -1])
        _sync(device)
        t_prefill = time.perf_counter() - t0

        # Keys a decode step may attend to: the prompt's real tokens, then each generated slot
        # as it is written. Additive mask over the whole cache (static shape for CUDA graphs).
        mask = torch.full((batch, 1, 1, cache.length), float("-inf"), dtype=dtype, device=device)
        mask[:, 0, 0, :prompt_len] = torch.where(valid, 0.0, float("-inf")).to(dtype)
        if graph is not None:
            graph.mask.copy_(mask)
            mask = graph.mask
        # [B]: text continues after the prompt's largest position (mrope: over all three axes)
        next_position = positions.reshape(-1, batch, prompt_len).amax(dim=(0, 2)) + 1
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
                if steps % _STOP_CHECK_EVERY == 0 and bool(finished.all()):
                    break
            if steps == params.max_new_tokens:
                break
            slot = prompt_len + step
            mask[:, :, :, slot] = 0.0
            position = next_position + step
            if graph is not None:
                logits = graph.run(token, position, slot)
            else:
                cos, sin = decoder.rotary_decode(position, dtype)
                hidden = decoder.forward(
                    decoder.embed(token[:, None]), cos, sin, cache, slot, mask[:, :, :, : slot + 1]
                )
                logits = decoder.logits(hidden[:, -1])
        _sync(device)
        total = time.perf_counter() - t0
        self.last_timings = {
            "prefill_s": t_prefill,
            "total_s": total,
            "steps": steps,
            "decode_ms_per_step": 1e3 * (total - t_prefill) / max(steps - 1, 1),
        }
        return _completions(tokens[:, :steps].tolist(), logprobs[:, :steps].tolist(), params)


def _prefill_mask(valid: torch.Tensor, dtype) -> torch.Tensor:
    """Additive [B, 1, S, S]: causal, padded keys blocked; a padded query may see itself (no NaN)."""
    length = valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    allowed = (causal[None, None] & valid[:, None, None, :]) | torch.eye(
        length, dtype=torch.bool, device=valid.device
    )[None, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(
        ~allowed, float("-inf")
    )


def _left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        valid[i, width - len(row) :] = True
    return ids.to(device), valid.to(device)


def _completions(
    tokens: list[list[int]], logprobs: list[list[float]], params: SamplingParams
) -> list[Completion]:
    out = []
    stops = set(params.stop_token_ids)
    for row_tokens, row_logprobs in zip(tokens, logprobs):
        end, reason = len(row_tokens), "length"
        if not params.ignore_eos:
            for i, tok in enumerate(row_tokens):
                if tok in stops:
                    end, reason = i + 1, "stop"
                    break
        out.append(
            Completion(
                token_ids=row_tokens[:end], logprobs=row_logprobs[:end], finish_reason=reason
            )
        )
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
