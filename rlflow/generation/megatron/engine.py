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
4. retire: every few steps, rows that stopped leave the batch and give their cache blocks
   back: the live rows move to the front of the block table and the next smaller bucket's
   graph takes over, so finished rows stop costing;
5. size: the KV cache is paged (rlflow/generation/megatron/kv_cache.py): it holds what rows use, not
   their worst case, so the whole rollout set usually runs in one pass. Where it does not fit,
   rlflow/generation/megatron/schedule.py admits whole prompt groups per pass and preempts rows that
   outgrow the cache (they run again in a later pass, with the same seeds).

A hybrid model (Nemotron-H) runs through rlflow/generation/megatron/hybrid_decoder.py: the same
steps, with each row's Mamba conv and SSM state in a slot beside its KV blocks (mamba_state.py).

Sampling is per row and counter-based (rlflow/generation/megatron/sampling.py): a row's tokens depend on
its seed only, so sharing, retiring and resizing never change them. Logprobs are of the
unmodified (temperature-1) distribution.
"""

from __future__ import annotations

import time

import torch

from rlflow.errors import Diagnostic, RlflowError
from rlflow.generation.base import Completion, GenerationBackend, SamplingParams
from rlflow.generation.megatron import fp8 as fp8_ops
from rlflow.generation.megatron.decoder import DecodeGraph, Decoder
from rlflow.generation.megatron.hybrid_decoder import HybridDecoder, make_decoder
from rlflow.generation.megatron.kv_cache import BLOCK, KVCache, blocks_for
from rlflow.generation.megatron.lockstep import Lockstep
from rlflow.generation.megatron.mamba_state import HybridCache
from rlflow.generation.megatron.moe_decode import RoutingRecord
from rlflow.generation.megatron.prefill import packed_prompts, prefill_slots
from rlflow.generation.megatron.sampling import row_seeds, sample_tokens
from rlflow.generation.megatron.schedule import RESERVE_SHARE, Batch, admit
from rlflow.model.media import Prompt

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
        release_cache: bool,
        cache_tokens: int,
    ):
        self.policy = policy
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size  # 0: as many rows as free memory holds
        device = policy.device
        self.device = device
        self.cuda_graphs = cuda_graphs and device.type == "cuda"  # graphs exist on GPUs only
        self.compile_decode = compile_decode and self.cuda_graphs  # compiled for GPU graphs only
        self.share_prompts = share_prompts
        if fp8:  # decode matmuls in FP8 (generation/megatron/fp8.py); refused without FP8 GPUs
            fp8_ops.require(device)
        self.fp8 = fp8
        self._stale = False  # FP8 copies older than the policy's weights
        self._decoder: Decoder | None = None
        self._cache: KVCache | None = None  # GPU: kept across calls (the graphs point into it)
        # `generation.release_cache` (recipes/base.yaml says why): cache and graphs are freed
        # after every call, so logprobs and the update get that memory back; the graphs are
        # captured again at the next call. factory.make_backend decides it by the engine's role.
        self.release_cache = release_cache
        self.cache_tokens = cache_tokens  # 0: sized from free GPU memory (CPU: worst case)
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
            if self.release_cache and self._cache is not None:
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
            self._decoder = make_decoder(core, compile_decode=self.compile_decode)
            self._decoder.set_fp8(self.fp8)
        elif self._stale:
            start = time.perf_counter()
            self._decoder.requantize()
            _sync(self.device)
            self.last_requantize_s = time.perf_counter() - start
        self._stale = False
        unique, row_prompt = _share(prompts) if self.share_prompts else _unshared(prompts)
        ids = [self.policy.prompt_ids(p) for p in unique]
        max_len = max((len(i) for i in ids), default=1) + params.max_new_tokens
        if self.cuda_graphs:  # round up, so one cache (and its graphs) serves many calls
            max_len = -(-max_len // 256) * 256
        seeds = row_seeds(params.seed, len(prompts), self.device)
        results: list[Completion | None] = [None] * len(prompts)
        t0 = time.perf_counter()
        self.last_timings = {"prefill_s": 0.0, "steps": 0, "passes": 0, "preempted": 0}
        lockstep = Lockstep.of(self._decoder, self.device)
        (most,) = lockstep.max(len(prompts))  # expert parallelism: the busiest rank's rows
        # (a pass never holds more than max_batch_size rows: admit caps it)
        cache = self._cache_for(max(min(most, self.max_batch_size or most), 1), max_len)
        prompt_len = [len(ids[p]) for p in row_prompt]
        reserve = max(params.max_new_tokens // RESERVE_SHARE, _STOP_CHECK_EVERY + 1)
        pending = list(range(len(prompts)))
        while True:  # passes, until no rank has rows left
            (more,) = lockstep.max(len(pending))
            if not more:
                break
            rows = admit(
                pending, prompt_len, row_prompt, free_blocks=cache.blocks - 1,
                max_rows=self.max_batch_size, reserve=reserve, max_len=max_len,
            )  # fmt: skip
            done, preempted = self._run(
                core, unique, ids, rows, row_prompt, seeds, params, cache, lockstep
            )
            for r, c in done.items():
                results[r] = c
            ran = set(rows)
            pending = sorted(preempted + [r for r in pending if r not in ran])
            self.last_timings["passes"] += 1
            self.last_timings["preempted"] += len(preempted)
        _sync(self.device)
        total = time.perf_counter() - t0
        self.last_timings["total_s"] = total
        steps = max(self.last_timings["steps"], 2)
        self.last_timings["decode_ms_per_step"] = (
            1e3 * (total - self.last_timings["prefill_s"]) / (steps - 1)
        )
        return results  # type: ignore[return-value]

    def _pool_blocks(self, worst: int, rows: int) -> int:
        """Cache blocks: `generation.kv_cache_tokens`, else what half of the free GPU memory
        holds after the rows' Mamba states (hybrid models; the whole worst case on a CPU),
        never more than the worst case."""
        if self.cache_tokens:
            return min(worst, blocks_for(self.cache_tokens) + 1)
        if self.device.type != "cuda":
            return worst
        d = self._decoder.dims
        per_block = BLOCK * KVCache.bytes_per_token(
            len(self._decoder.layers), d.kv_heads, d.head_dim, self.policy.dtype
        )
        held = 0  # a kept cache (KV blocks and Mamba states) is freed before a larger one
        if self._cache is not None:
            held = self._cache.blocks * per_block + self._cache.rows * (
                HybridDecoder.state_bytes_per_row(self._decoder, self.policy.dtype)
            )
        if self.release_cache:
            # The trainer's engine: blocks the allocator caches belong to no tensor now (the
            # cache is freed before logprobs and the update run, which allocate them again).
            torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        states = (rows + 1) * HybridDecoder.state_bytes_per_row(self._decoder, self.policy.dtype)
        return min(worst, (int((free + held) * _CACHE_MEMORY_SHARE) - states) // per_block)

    def _cache_for(self, rows: int, max_len: int) -> KVCache:
        """A cache with a block table for `rows` batch positions and rows up to max_len tokens."""
        decoder, dtype = self._decoder, self.policy.dtype
        blocks = self._pool_blocks(rows * blocks_for(max_len) + 1, rows)
        if blocks - 1 < blocks_for(max_len):
            states = (rows + 1) * HybridDecoder.state_bytes_per_row(decoder, dtype)
            beside = f", beside {states / 2**30:.1f} GiB of {rows} rows' Mamba states" * bool(
                states
            )
            raise _cache_error(
                f"the KV cache ({max(blocks - 1, 0)} blocks of {BLOCK} tokens{beside}) cannot "
                f"hold one row of {max_len} tokens (the longest prompt + "
                "generation.max_new_tokens)",
                "raise generation.kv_cache_tokens (0 sizes it from free GPU memory), or lower "
                "generation.max_new_tokens"
                + (" or generation.max_batch_size (rows per pass)" if states else ""),
            )
        make = dict(blocks=blocks, rows=rows, max_len=max_len, dtype=dtype, device=self.device)
        if not self.cuda_graphs:
            return _new_cache(decoder, make)
        cache = self._cache
        if (
            cache is None
            or cache.rows < rows
            or cache.max_blocks < blocks_for(max_len) + 1
            or cache.blocks < blocks
        ):
            self._graphs.clear()
            self._cache = None
            torch.cuda.empty_cache()
            self._cache = cache = _new_cache(decoder, make)
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

    def _run(self, core, unique, ids, rows, row_prompt, seeds, params, cache, lockstep):
        """One pass: the unique prompts of `rows` prefilled once, then the rows decoded ->
        ({row: completion}, rows preempted: they run again in a later pass)."""
        device, decoder = self.device, self._decoder
        order = sorted({row_prompt[r] for r in rows})  # unique prompts, packed in this order
        slot_of = {p: i for i, p in enumerate(order)}
        n = len(rows)
        lengths_p = [len(ids[p]) for p in order]
        tokens, rows_agreed = lockstep.max(sum(lengths_p), n)  # (expert parallelism)
        if rows_agreed == 0:  # no EP rank has rows in this pass
            return {}, []
        buckets = batch_buckets(rows_agreed) if self.cuda_graphs else None
        capacity = buckets[-1] if buckets else rows_agreed
        batch = Batch([len(ids[row_prompt[r]]) for r in rows], capacity, _STOP_CHECK_EVERY + 1)
        batch.first_blocks(cache)
        t0 = time.perf_counter()

        # 1. prefill the unique prompts once, packed; copy their keys/values to their rows
        pack, attend, inputs, cos, sin, next_pos = packed_prompts(
            core, [unique[p] for p in order], [ids[p] for p in order], tokens,
            decoder=decoder, policy=self.policy, pad_token_id=self.pad_token_id, device=device,
        )  # fmt: skip
        row_slot = torch.tensor(
            [slot_of[row_prompt[r]] for r in rows], dtype=torch.long, device=device
        )
        dest, src = prefill_slots(pack, row_slot, cache)
        if isinstance(cache, HybridCache):  # which batch positions hold each prompt's samples
            cache.share([slot_of[row_prompt[r]] for r in rows])
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
            cache, batch, logits, lengths, positions, seeds_live, buckets, params, record,
            lockstep,
        )  # fmt: skip
        if record is not None:
            completions = record.attach(completions, pack.cu_seqlens, row_slot)
        gone = set(batch.preempted)
        done = {r: c for i, (r, c) in enumerate(zip(rows, completions)) if i not in gone}
        return done, [rows[i] for i in batch.preempted]

    def _decode(
        self, cache, batch, logits, lengths, positions, seeds_live, buckets, params, record,
        lockstep,
    ):  # fmt: skip
        """Sample and decode until every row stopped, retiring finished rows at every check.

        The batch is padded up to its bucket; output row n is a sink for the padding rows (it
        starts finished), so no step needs a host sync. `batch` (rlflow/generation/megatron/schedule.py)
        keeps the host's copy of the positions and their cache blocks.
        """
        device, n = self.device, logits.shape[0]
        capacity = len(batch.out)
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
        size = capacity
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
            if (step + 1) % _STOP_CHECK_EVERY == 0:
                if params.ignore_eos:  # nothing stops: the host knows who is alive
                    alive = batch.alive
                else:
                    alive = (~finished.index_select(0, live_ids)).tolist()
                victims = batch.check(cache, step, alive)
                if victims:  # out of cache blocks: these rows leave and run again later
                    gone = torch.tensor([batch.out[p] for p in victims], device=device)
                    finished[gone] = True
                count = sum(batch.alive)
                trace.append((step + 1, size, count, round(time.perf_counter() - t0, 4)))
                # expert parallelism: the busiest rank's rows; whether any rank is below its
                # params.stop_fraction of finished rows (partial rollouts: the rest end `budget`)
                agreed, short = lockstep.max(count, int(count > n - n * params.stop_fraction))
                if agreed == 0 or not short:
                    break
                smaller = _bucket(buckets, agreed) if buckets else agreed
                if smaller < size:
                    order = torch.tensor(batch.compact(cache, smaller), device=device)
                    live_ids, lengths, positions, seeds_live, token = (
                        t.index_select(0, order)
                        for t in (live_ids, lengths, positions, seeds_live, token)
                    )
                    size = smaller
                batch.grow(cache, step)
            lengths = lengths + 1
            logits = step_fn(token, positions + step, lengths, size)
            if record is not None:
                live = ~finished.index_select(0, live_ids)
                record.record_step(step, live_ids, live, self._step_routing)
        self.last_timings["steps"] = max(self.last_timings["steps"], step + 1)
        self.last_timings["trace"] = trace  # (step, batch, live rows, seconds since prefill)
        return _completions(out_tokens[:, :n].T, out_logprobs[:, :n].T, steps_done[:n], params)


def _expert_parallel(core) -> bool:
    from megatron.core import parallel_state

    from rlflow.model.moe.routing import is_moe

    return parallel_state.get_expert_model_parallel_world_size() > 1 and is_moe(core)


def _first_row(t: torch.Tensor, count: int) -> torch.Tensor:
    """`count` copies of t's first row (zeros when t has none: an EP rank without rows)."""
    if t.shape[0]:
        return t[:1].expand(count, *t.shape[1:])
    return t.new_zeros(count, *t.shape[1:])


def _new_cache(decoder: Decoder, make: dict) -> KVCache:
    try:
        return decoder.new_cache(**make)
    except torch.OutOfMemoryError:
        raise _cache_error(
            f"a KV cache of {make['blocks'] - 1} blocks of {BLOCK} tokens does not fit in GPU "
            "memory",
            "lower generation.kv_cache_tokens, or set it to 0 (half of the free GPU memory)",
        ) from None


def _cache_error(message: str, fix: str) -> RlflowError:
    return RlflowError(Diagnostic("recipe.kv-cache-size", message, help=fix))


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
        elif n < params.max_new_tokens:  # the pass ended at params.stop_fraction
            reason = "budget"
        out.append(
            Completion(
                token_ids=row_tokens[:end], logprobs=row_logprobs[:end], finish_reason=reason
            )
        )
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
