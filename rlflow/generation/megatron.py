"""Multimodal generation straight from the Megatron policy, shaped for GRPO rollouts.

The trainer's own weights generate the rollouts (no copy, no weight sync). megatron-core 0.19.2's
engines do not fit here: the dynamic engine needs flash-attn; the legacy static engine is batch-1
for VLMs, re-applies RoPE to the whole cache and expands GQA heads every step. So rlflow drives
the policy itself. A GRPO step asks for G samples of each of P prompts, of ragged lengths, most
stopping well before the cap; the engine is built around that shape:

1. share: rows that carry the same `Prompt` object (a prompt's G samples) are one *unique*
   prompt: its vision tower and its prefill run once, and its keys/values are copied into the
   cache rows of all G samples;
2. prefill: the unique prompts packed end to end (no padding), vision features scattered at the
   image/video pad tokens (DeepStack's part added after the first layers), the family's rotary
   positions per prompt (3-D for the mrope families);
3. decode: one token per live row per step; on a GPU the step is a CUDA graph replayed for the
   current batch bucket;
4. retire: every few steps, rows that stopped leave the batch: the live rows move to the front
   of the cache and the next smaller bucket's graph takes over, so finished rows stop costing;
5. size: the whole rollout set runs in one pass when its KV cache fits in free memory
   (`generation.max_batch_size` can cap it), else in passes of whole prompt groups.

Sampling is per row and counter-based (rlflow/generation/sampling.py): a row's tokens depend on
its seed only, so sharing, retiring and resizing never change them. Logprobs are of the
unmodified (temperature-1) distribution.
"""

from __future__ import annotations

import time

import torch

from rlflow.generation import fp8 as fp8_ops
from rlflow.generation.base import Completion, GenerationBackend, SamplingParams
from rlflow.generation.decoder import DecodeGraph, Decoder, KVCache
from rlflow.generation.lockstep import Lockstep
from rlflow.generation.moe_decode import RoutingRecord
from rlflow.generation.sampling import row_seeds, sample_tokens
from rlflow.model.deepstack import Embedded
from rlflow.model.family import of_core
from rlflow.model.forward import embed
from rlflow.model.media import Media, Prompt
from rlflow.model.packed_attention import Packing

# Check "which rows have stopped?" every few steps: each check is a device->host sync.
_STOP_CHECK_EVERY = 8
# Share of free GPU memory the KV cache may take (the rest: logits, graphs, training's buffers).
_CACHE_MEMORY_SHARE = 0.5


def batch_buckets(limit: int) -> list[int]:
    """Batch sizes the decode step runs at: 1, 2, 4, 6, 8, 12, 16, 24, ... up to `limit`."""
    sizes, power = {1, 2}, 4
    while power < limit:
        sizes.update((power, power * 3 // 2))
        power *= 2
    return sorted({s for s in sizes if s < limit} | {limit})


class MegatronGeneration(GenerationBackend):
    """Rollouts from the policy's own Megatron modules (weights shared with training)."""

    name = "megatron"

    def __init__(
        self,
        policy,
        pad_token_id: int,
        *,
        max_batch_size: int,
        cuda_graphs: bool,
        compile_decode: bool,
        share_prompts: bool,
        fp8: bool,
        keep_cache: bool,
    ):
        self.policy = policy
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size  # 0: as many rows as free memory holds
        device = policy.device
        self.device = device
        self.cuda_graphs = cuda_graphs and device.type == "cuda"  # graphs exist on GPUs only
        self.compile_decode = compile_decode and self.cuda_graphs  # compiled for GPU graphs only
        self.share_prompts = share_prompts
        if fp8:  # decode matmuls in FP8 (rlflow/generation/fp8.py); refused without FP8 GPUs
            fp8_ops.require(device)
        self.fp8 = fp8
        self._stale = False  # FP8 copies older than the policy's weights
        self._decoder: Decoder | None = None
        self._cache: KVCache | None = None  # GPU: kept across calls (the graphs point into it)
        # False (`generation.release_cache`, the trainer's engine): cache and graphs are freed
        # after every call, so logprobs and the update get that memory back (recipes/base.yaml
        # says why); the graphs are captured again at the next call.
        self.keep_cache = keep_cache
        self._graphs: dict[int, DecodeGraph] = {}
        self._step_routing: torch.Tensor | None = None  # MoE: experts per row, every step
        self._pool = None
        self.last_timings: dict[str, float] = {}

    # --- public -----------------------------------------------------------------------------------

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Completion]:
        if not prompts and not _expert_parallel(self.policy.core):
            return []  # (an expert-parallel rank still joins its peers' passes)
        core = self.policy.core
        was_training = core.training
        core.eval()
        try:
            with torch.no_grad():
                return self._generate(core, prompts, params)
        finally:
            core.train(was_training)
            if not self.keep_cache and self._cache is not None:
                self.close()
                torch.cuda.empty_cache()

    def refresh_weights(self, version: int | None = None) -> float:
        """bf16 reads the policy's tensors in place (nothing to do); FP8 copies are re-quantized
        before the next rollout."""
        self.weight_version = self.next_version(version)
        self._stale = self.fp8
        return 0.0

    def close(self) -> None:
        self._graphs.clear()
        self._cache = None
        self._step_routing = None

    # --- planning ---------------------------------------------------------------------------------

    def _generate(self, core, prompts: list[Prompt], params: SamplingParams) -> list[Completion]:
        if self._decoder is None:  # views of the weights: built once, current after every update
            self._decoder = Decoder(core, compile_decode=self.compile_decode)
            self._decoder.set_fp8(self.fp8)
        elif self._stale:
            start = time.perf_counter()
            self._decoder.requantize()
            _sync(self.device)
            self.last_requantize_s = time.perf_counter() - start
        self._stale = False
        unique, row_prompt = _share(prompts) if self.share_prompts else _unshared(prompts)
        ids = [self.policy.prompt_ids(p) for p in unique]
        length = max((len(i) for i in ids), default=1) + params.max_new_tokens
        if self.cuda_graphs:
            # +1: the last slot is the graphs' warm-up scratch; round up so one cache (and its
            # graphs) serves many steps
            length = -(-(length + 1) // 256) * 256
        seeds = row_seeds(params.seed, len(prompts), self.device)
        results: list[Completion | None] = [None] * len(prompts)
        t0 = time.perf_counter()
        self.last_timings = {"prefill_s": 0.0, "steps": 0, "passes": 0}
        lockstep = Lockstep.of(self._decoder, self.device)
        groups = self._passes(row_prompt, len(unique), length)
        (passes,) = lockstep.max(len(groups))
        for group in groups + [set()] * (passes - len(groups)):
            rows = [r for r in range(len(prompts)) if row_prompt[r] in group]
            completions = self._run(
                core, unique, ids, group, rows, row_prompt, seeds, params, length, lockstep
            )
            for r, c in zip(rows, completions):
                results[r] = c
            self.last_timings["passes"] += 1
        _sync(self.device)
        total = time.perf_counter() - t0
        self.last_timings["total_s"] = total
        steps = max(self.last_timings["steps"], 2)
        self.last_timings["decode_ms_per_step"] = (
            1e3 * (total - self.last_timings["prefill_s"]) / (steps - 1)
        )
        return results  # type: ignore[return-value]

    def _passes(self, row_prompt: list[int], num_unique: int, length: int) -> list[set[int]]:
        """Unique prompts per pass: whole prompt groups, as many rows as memory allows."""
        limit = self._row_limit(length)
        per_prompt = [0] * num_unique
        for p in row_prompt:
            per_prompt[p] += 1
        passes, current, rows = [], set(), 0
        for p in range(num_unique):
            if current and rows + per_prompt[p] > limit:
                passes.append(current)
                current, rows = set(), 0
            current.add(p)
            rows += per_prompt[p]
        passes.append(current)
        return passes

    def _row_limit(self, length: int) -> int:
        limit = self.max_batch_size or 1 << 30
        if self.device.type == "cuda":
            d = self._decoder.dims
            per_row = length * KVCache.bytes_per_token(
                len(self._decoder.layers), d.kv_heads, d.head_dim, self.policy.dtype
            )
            held = 0  # the kept cache is freed before a larger one is made
            if self._cache is not None:
                held = self._cache.rows * self._cache.length * per_row // length
            # Only what the driver has free: blocks PyTorch's allocator holds but no tensor
            # uses now are the trainer's logprob and update buffers, which the next update
            # needs again (the cache stays allocated through it, for the CUDA graphs).
            # Counting them grew the cache at step 2 and ran the update out of memory.
            free, _ = torch.cuda.mem_get_info(self.device)
            rows = int((free + held) * _CACHE_MEMORY_SHARE) // per_row
            limit = min(limit, max(1, held // per_row, rows))
        return limit

    def _cache_for(self, rows: int, length: int) -> KVCache:
        decoder, dtype = self._decoder, self.policy.dtype
        if not self.cuda_graphs:
            return decoder.new_cache(rows, length, dtype, self.device)
        cache = self._cache
        if cache is None or cache.rows < rows or cache.length < length:
            self._graphs.clear()
            self._cache = None
            torch.cuda.empty_cache()
            self._cache = cache = decoder.new_cache(rows, length, dtype, self.device)
            self._pool = torch.cuda.graph_pool_handle()
            self._step_routing = None
        return cache

    def _step_fn(self, cache: KVCache):
        """decode(tokens, positions, lengths, rows) for the current batch bucket."""
        decoder = self._decoder
        routing = self._step_routing
        if not self.cuda_graphs:
            return lambda tokens, positions, lengths, rows: decoder.decode(
                tokens, positions, lengths, cache, rows,
                None if routing is None else routing[:rows],
            )  # fmt: skip

        def step(tokens, positions, lengths, rows):
            if rows not in self._graphs:
                buffer = None if routing is None else routing[:rows]
                self._graphs[rows] = DecodeGraph(decoder, cache, rows, self._pool, buffer)
            return self._graphs[rows].run(tokens, positions, lengths)

        return step

    # --- one pass ---------------------------------------------------------------------------------

    def _run(self, core, unique, ids, group, rows, row_prompt, seeds, params, length, lockstep):
        """One pass: the unique prompts in `group` prefilled once, then their `rows` decoded."""
        device, decoder = self.device, self._decoder
        order = sorted(group)  # unique prompts of this pass, packed in this order
        slot_of = {p: i for i, p in enumerate(order)}
        n = len(rows)
        lengths_p = [len(ids[p]) for p in order]
        tokens, rows_agreed = lockstep.max(sum(lengths_p), n)  # (expert parallelism)
        if rows_agreed == 0:  # no EP rank has rows in this pass
            return []
        buckets = batch_buckets(rows_agreed) if self.cuda_graphs else None
        capacity = buckets[-1] if buckets else rows_agreed
        cache = self._cache_for(capacity, length)
        length = cache.length  # a kept cache may be longer than this call needs
        t0 = time.perf_counter()

        # 1. prefill the unique prompts once, packed; copy their keys/values to their rows
        pack, attend, inputs, cos, sin, next_pos = self._packed_prompts(
            core, [unique[p] for p in order], [ids[p] for p in order], tokens
        )
        row_slot = torch.tensor(
            [slot_of[row_prompt[r]] for r in rows], dtype=torch.long, device=device
        )
        dest, src = _prefill_slots(pack, row_slot, length)
        record = None
        if decoder.topk:  # MoE: every token's experts, for router replay
            record = RoutingRecord(decoder, n, params.max_new_tokens, device)
            record.prompts = record.buffer((inputs.hidden.shape[0],), device)
            if self._step_routing is None or self._step_routing.shape[0] < capacity:
                self._step_routing = record.buffer((capacity,), device)
                self._graphs.clear()  # graphs point into the old buffer
        hidden = decoder.prefill(
            inputs.hidden, cos, sin, attend, cache, dest, src,
            None if record is None else record.prompts, deepstack=inputs.deepstack,
        )  # fmt: skip
        last = pack.cu_seqlens[1:].long()[: len(order)] - 1
        prompt_logits = decoder.logits(hidden.index_select(0, last))  # [unique, V]
        logits = prompt_logits.index_select(0, row_slot)
        _sync(device)
        self.last_timings["prefill_s"] += time.perf_counter() - t0

        # 2. decode: every row starts with its prompt's logits, length and next text position
        lengths = torch.tensor(lengths_p, dtype=torch.long, device=device).index_select(0, row_slot)
        positions = next_pos.to(device).index_select(0, row_slot)
        seeds_live = seeds.index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
        completions = self._decode(
            cache, logits, lengths, positions, seeds_live, buckets, params, record,
            capacity, lockstep,
        )  # fmt: skip
        if record is None:
            return completions
        return record.attach(completions, pack.cu_seqlens, row_slot)

    def _decode(
        self, cache, logits, lengths, positions, seeds_live, buckets, params, record, capacity,
        lockstep,
    ):  # fmt: skip
        """Sample and decode until every row stopped, retiring finished rows at every check.

        The batch is padded up to `capacity` (its bucket); output row n is a sink for the
        padding rows (it starts finished), so no step needs a host sync.
        """
        device, n = self.device, logits.shape[0]
        trash, pad = n, capacity - n
        live_ids = torch.arange(capacity, device=device).clamp_(max=trash)
        lengths = torch.cat([lengths, torch.ones(pad, dtype=torch.long, device=device)])
        positions = torch.cat([positions, torch.zeros(pad, dtype=torch.long, device=device)])
        seeds_live = torch.cat([seeds_live, _first_row(seeds_live, pad)])
        logits = torch.cat([logits, _first_row(logits, pad)]) if pad else logits
        finished = torch.zeros(n + 1, dtype=torch.bool, device=device)
        finished[trash] = True
        # step-major, so a step's column is a plain view: indexing it by row ids alone never
        # turns a Python int into a host->device copy (which would sync every step)
        out_tokens = torch.zeros(params.max_new_tokens, n + 1, dtype=torch.long, device=device)
        out_logprobs = torch.zeros(params.max_new_tokens, n + 1, device=device)
        steps_done = torch.zeros(n + 1, dtype=torch.long, device=device)
        # A lookup table rather than torch.isin: on a GPU, isin sorts through torch.unique (a
        # host sync every step) once the batch has more than ~10 rows.
        vocab = logits.shape[-1]
        is_stop = torch.zeros(vocab, dtype=torch.bool, device=device)
        sampled_stops = [t for t in params.stop_token_ids if 0 <= t < vocab]
        is_stop[torch.tensor(sampled_stops, dtype=torch.long, device=device)] = True
        step_fn = self._step_fn(cache)
        batch = capacity
        trace: list[tuple[int, int, int, float]] = []
        t0 = time.perf_counter()
        for step in range(params.max_new_tokens):
            token, logprob = sample_tokens(logits, params, seeds_live, step)
            was_finished = finished.index_select(0, live_ids)
            keep = ~was_finished
            column_tokens, column_logprobs = out_tokens[step], out_logprobs[step]
            column_tokens[live_ids] = torch.where(keep, token, column_tokens[live_ids])
            column_logprobs[live_ids] = torch.where(keep, logprob, column_logprobs[live_ids])
            steps_done[live_ids] = torch.where(keep, step + 1, steps_done[live_ids])
            if not params.ignore_eos:
                finished[live_ids] = was_finished | is_stop[token]
            if step + 1 == params.max_new_tokens:
                break
            if not params.ignore_eos and (step + 1) % _STOP_CHECK_EVERY == 0:
                alive = ~finished.index_select(0, live_ids)
                count = int(alive.sum())
                trace.append((step + 1, batch, count, round(time.perf_counter() - t0, 4)))
                (agreed,) = lockstep.max(count)  # expert parallelism: the busiest rank's rows
                if agreed == 0:
                    break
                smaller = _bucket(buckets, agreed) if buckets else agreed
                if smaller < batch:
                    order = torch.cat([alive.nonzero()[:, 0], (~alive).nonzero()[:, 0]])[:smaller]
                    cache.compact(order)
                    live_ids, lengths, positions, seeds_live, token = (
                        t.index_select(0, order)
                        for t in (live_ids, lengths, positions, seeds_live, token)
                    )
                    batch = smaller
            lengths = lengths + 1
            logits = step_fn(token, positions + step, lengths, batch)
            if record is not None:
                live = ~finished.index_select(0, live_ids)
                record.record_step(step, live_ids, live, self._step_routing)
        self.last_timings["steps"] = max(self.last_timings["steps"], step + 1)
        self.last_timings["trace"] = trace  # (step, batch, live rows, seconds since prefill)
        return _completions(out_tokens[:, :n].T, out_logprobs[:, :n].T, steps_done[:n], params)

    def _packed_prompts(self, core, prompts, ids, tokens: int):
        """(pack, attend, inputs, cos, sin, next positions) of this rank's prompts, packed.

        Expert parallelism: every EP rank of a pass runs `tokens` prefill tokens (the group's
        most), so their all-to-alls line up: `attend` adds one padding sequence where this rank
        has fewer (or none at all)."""
        device = self.device
        if prompts:
            pack = Packing.of([len(i) for i in ids], device)
            inputs, cos, sin, next_pos = _prefill_inputs(
                core, prompts, ids, pack, decoder=self._decoder, policy=self.policy,
                pad_token_id=self.pad_token_id, device=device,
            )  # fmt: skip
        else:  # an expert-parallel rank with nothing left to generate joins its peers
            pack, next_pos = Packing.of([0], device), torch.zeros(0, dtype=torch.long)
            hidden, cos, sin = _no_tokens(self._decoder, self.policy.dtype, device)
            inputs = Embedded(hidden)
        attend = pack
        if tokens > pack.total:
            hidden, cos, sin = _pad_tokens(inputs.hidden, cos, sin, tokens - pack.total)
            inputs = Embedded(hidden, inputs.deepstack)  # (features address real positions)
            attend = Packing.of([*[len(i) for i in ids], tokens - pack.total], device)
        return pack, attend, inputs, cos, sin, next_pos


def _no_tokens(decoder, dtype, device):
    """Empty packed inputs: hidden [0, H], cos/sin [0, 1, D]."""
    hidden = torch.zeros(0, decoder.final_norm.shape[0], dtype=dtype, device=device)
    cos = torch.zeros(0, 1, decoder.dims.head_dim, dtype=dtype, device=device)
    return hidden, cos, cos


def _prefill_inputs(core, prompts, ids, pack: Packing, *, decoder, policy, pad_token_id, device):
    """Packed inputs (embeddings [T, H], DeepStack features), cos/sin [T, 1, D] and each
    prompt's next text position.

    A right-padded batch of the unique prompts gives the family's positions and the vision
    features per prompt; then only the real tokens are kept (the LM never sees padding)."""
    dtype = policy.dtype
    width = pack.max_len
    padded = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
    valid = torch.zeros((len(ids), width), dtype=torch.bool)
    for i, row in enumerate(ids):
        padded[i, : len(row)] = torch.tensor(row)
        valid[i, : len(row)] = True
    padded, valid = padded.to(device), valid.to(device)
    media_rows = [p.media for p in prompts]
    media = Media.concat(media_rows).to(device)
    positions = of_core(core).positions(core, padded, valid, media)  # [(3,) P, W]
    features = None
    if media.num_images or media.num_videos:
        features = policy.vision_cache.features(core, media_rows)
    inputs = embed(core, padded, media, features=features)  # [W, P, H]
    inputs.hidden = inputs.hidden.transpose(0, 1)[valid]  # [T, H]
    if inputs.deepstack is not None:
        inputs.deepstack = inputs.deepstack.packed(valid)
    cos, sin = decoder.rotary(positions[..., valid], dtype)
    last = positions.masked_fill(~valid, 0).reshape(-1, *valid.shape).amax(dim=(0, 2))
    return inputs, cos, sin, last + 1


def _expert_parallel(core) -> bool:
    from megatron.core import parallel_state

    from rlflow.model.routing import is_moe

    return parallel_state.get_expert_model_parallel_world_size() > 1 and is_moe(core)


def _pad_tokens(hidden, cos, sin, count: int):
    """`count` padding tokens after the packed prompts: zero states, no rotation."""
    return (
        torch.cat([hidden, hidden.new_zeros(count, hidden.shape[-1])]),
        torch.cat([cos, cos.new_ones(count, *cos.shape[1:])]),
        torch.cat([sin, sin.new_zeros(count, *sin.shape[1:])]),
    )


def _first_row(t: torch.Tensor, count: int) -> torch.Tensor:
    """`count` copies of t's first row (zeros when t has none: an EP rank without rows)."""
    if t.shape[0]:
        return t[:1].expand(count, *t.shape[1:])
    return t.new_zeros(count, *t.shape[1:])


def _prefill_slots(pack: Packing, row_slot: torch.Tensor, length: int):
    """(dest, src): cache slot row*length + j <- packed token start(prompt of row) + j."""
    lengths = torch.tensor(pack.lengths, device=row_slot.device)[row_slot]  # per row
    starts = pack.cu_seqlens[:-1].long()[row_slot]
    row_of_token = torch.repeat_interleave(
        torch.arange(len(row_slot), device=row_slot.device), lengths
    )
    first = torch.cumsum(lengths, 0) - lengths  # each row's first entry in the flat list
    offset = torch.arange(int(lengths.sum()), device=row_slot.device) - first[row_of_token]
    return row_of_token * length + offset, starts[row_of_token] + offset


def _share(prompts: list[Prompt]) -> tuple[list[Prompt], list[int]]:
    """Unique prompts (by identity: a prompt's G samples are the same object) and each row's."""
    index: dict[int, int] = {}
    unique, row_prompt = [], []
    for p in prompts:
        if id(p) not in index:
            index[id(p)] = len(unique)
            unique.append(p)
        row_prompt.append(index[id(p)])
    return unique, row_prompt


def _unshared(prompts: list[Prompt]) -> tuple[list[Prompt], list[int]]:
    return list(prompts), list(range(len(prompts)))


def _bucket(buckets: list[int], count: int) -> int:
    return next(b for b in buckets if b >= count)


def _completions(tokens, logprobs, steps_done, params: SamplingParams) -> list[Completion]:
    tokens, logprobs, steps_done = tokens.tolist(), logprobs.tolist(), steps_done.tolist()
    out = []
    stops = set(params.stop_token_ids)
    for row_tokens, row_logprobs, n in zip(tokens, logprobs, steps_done):
        end, reason = n, "length"
        if not params.ignore_eos and n and row_tokens[n - 1] in stops:
            reason = "stop"
        out.append(
            Completion(
                token_ids=row_tokens[:end], logprobs=row_logprobs[:end], finish_reason=reason
            )
        )
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
