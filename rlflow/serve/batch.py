"""The serving engine's running batch: its rows, their KV cache blocks and next-token logits.

Used by rlflow/serve/engine.py (which explains the loop). Rows sit at batch positions 0..n-1;
position p owns block-table row p of the paged cache (rlflow/generation/megatron/kv_cache.py). New rows
are prefilled behind the running ones; rows that leave give their blocks back and the others
move to the front (block-table rows only, no key or value moves).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from rlflow.generation.megatron.decoder import DecodeGraph, Decoder
from rlflow.generation.megatron.engine import batch_buckets
from rlflow.generation.megatron.hybrid_decoder import HybridDecoder, make_decoder
from rlflow.generation.megatron.kv_cache import BLOCK, KVCache, blocks_for
from rlflow.generation.megatron.mamba_state import HybridCache
from rlflow.generation.megatron.prefill import packed_prompts, prefill_slots
from rlflow.serve.device_rows import DeviceRows, StepGraph
from rlflow.serve.requests import Choice, Request, RequestRefused

_CACHE_MEMORY_SHARE = 0.5  # of free GPU memory, as generate()'s cache
_ROW_IDS = itertools.count()


@dataclass(eq=False)
class Row:
    """One choice of a request while it is in the batch (or waits to be)."""

    request: Request
    index: int  # which choice
    prompt_len: int
    generated: int = 0  # tokens in its choice so far
    # the row's name in a tensor-parallel engine's plans (rlflow/serve/tensor_parallel.py)
    uid: int = field(default_factory=lambda: next(_ROW_IDS))

    @property
    def seed(self) -> int:
        return self.request.seeds[self.index]

    def restart(self) -> None:
        """Preempted: it runs again from its prompt (same seed, same tokens)."""
        self.generated = 0
        self.request.choices[self.index] = Choice()


@dataclass
class Stats:
    """Decode steps, rows summed over them (mean occupancy = rows / steps), tokens, preemptions."""

    steps: int = 0
    rows: int = 0
    tokens: int = 0
    requests: int = 0  # submitted to the engine
    prefills: int = 0
    preempted: int = 0
    cancelled: int = 0  # requests whose client went away (their rows freed at once)
    # wall seconds of the engine thread's phases (admit, prefill, step, ...): benchmarks read it
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @property
    def mean_occupancy(self) -> float:
        return self.rows / self.steps if self.steps else 0.0


class RunningBatch:
    """Rows on the device; only the engine's thread touches it."""

    step_graphs = True  # a whole decode step as one CUDA graph (False: decode graphs only)

    def __init__(
        self, policy, pad_token_id: int, *, max_rows: int, context_tokens: int,
        cache_tokens: int, cuda_graphs: bool, compile_decode: bool,
    ):  # fmt: skip
        self.policy = policy
        self.device = policy.device
        self.pad_token_id = pad_token_id
        self.max_rows = max_rows
        self.context_tokens = context_tokens
        self.core = policy.core
        self.core.eval()
        graphs = cuda_graphs and self.device.type == "cuda"
        # (compiled for GPU graphs only, as generate()'s decoder)
        self.decoder = make_decoder(self.core, compile_decode=compile_decode and graphs)
        self.cache = new_cache(policy, self.decoder, max_rows, context_tokens, cache_tokens)
        if isinstance(self.cache, HybridCache):
            # A step graph's warm-up runs decode on the live rows (rewriting the same keys and
            # values); a Mamba state would advance: hybrids take the decode graphs, whose
            # warm-up writes scratch.
            self.step_graphs = False
        self._graphs: dict[int, DecodeGraph] = {}
        self._step_graphs: dict[tuple, StepGraph] = {}  # (bucket, DeviceRows.graph_key())
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self._buckets = batch_buckets(max_rows) if graphs else None
        self.rows: list[Row] = []  # in position order
        self.state = DeviceRows(max_rows, self.device)  # their sampling state on the device
        self._logits: torch.Tensor | None = None  # [rows, V]: each row's next-token logits
        self.stats = Stats()
        # a tensor-parallel engine's leader: the rows of each retire() since the last plan
        # (not a preemption's: grow() preempts the same rows on every rank)
        self.journal: list[list[int]] | None = None

    def prefill(self, new: list[Row], weight_version: int) -> None:
        """New rows join behind the running ones: their unique prompts (a request's choices,
        identical prompts of different requests) prefilled once, packed, into their blocks."""
        unique: dict[object, int] = {}  # a prompt's key -> its slot in the pack
        prompts, ids, slot = [], [], []
        for row in new:
            request = row.request
            key = prompt_key(request)
            if key not in unique:
                unique[key] = len(prompts)
                prompts.append(request.prompt)
                ids.append(request.prompt_ids)
            slot.append(unique[key])
            if request.weight_version < 0:
                request.weight_version = weight_version
        first = len(self.rows)
        self.cache.grow([0] * first + [r.prompt_len for r in new])
        self.cache.upload()
        decoder, device = self.decoder, self.device
        pack, attend, inputs, cos, sin, next_pos = packed_prompts(
            self.core, prompts, ids, sum(len(i) for i in ids), decoder=decoder,
            policy=self.policy, pad_token_id=self.pad_token_id, device=device,
        )  # fmt: skip
        row_slot = _on(torch.tensor(slot, dtype=torch.long), device)
        dest, src = prefill_slots(pack, row_slot, self.cache, first)
        if isinstance(self.cache, HybridCache):  # the new rows' Mamba state slots, per prompt
            self.cache.share(slot, first)
        hidden = decoder.prefill(
            inputs.hidden, cos, sin, attend, self.cache, dest, src, deepstack=inputs.deepstack
        )
        last = pack.cu_seqlens[1:].long()[: len(prompts)] - 1
        logits = decoder.logits(hidden.index_select(0, last)).index_select(0, row_slot)
        self.rows += new
        self.state.place(
            new, next_pos.to(device).index_select(0, row_slot), logits.shape[-1],
            self.context_tokens,
        )  # fmt: skip
        self._logits = logits if self._logits is None else torch.cat([self._logits, logits])
        self.stats.prefills += 1

    def run(self, steps: int) -> None:
        """`steps` decode steps of every row, no host sync: sample from the current logits,
        then steps-1 times decode-and-sample (on a GPU one CUDA graph each, when the rows
        sample alike), then decode: the logits the next interval starts from."""
        n = len(self.rows)
        size = next(b for b in self._buckets if b >= n) if self._buckets else n
        state = self.state
        state.column.zero_()  # (an interval cut short by an engine error left it anywhere)
        state.step(self._logits)
        key = state.graph_key() if self._buckets and self.step_graphs else None
        if key is not None and any(k[1][-1] != key[-1] for k in self._step_graphs):
            self._step_graphs.clear()  # they read a stop table that is gone
        for _ in range(steps - 1):
            if key is not None:
                if (size, key) not in self._step_graphs:
                    self._step_graphs[size, key] = StepGraph(
                        state, lambda *a: self._decode(size, *a), size, self._pool
                    )
                self._step_graphs[size, key].replay()
            else:
                state.step(self._decode_state(size)[:n])
        self._logits = self._decode_state(size)[:n]
        self.stats.steps += steps

    def _decode_state(self, size: int) -> torch.Tensor:
        """The decode step of the rows' last tokens (the batch padded to `size`)."""
        state = self.state
        tokens, positions = state.padded("last", size), state.padded("positions", size)
        lengths = state.padded("lengths", size)
        if not self._buckets:
            return self._decode(size, tokens, positions, lengths)
        if size not in self._graphs:
            self._graphs[size] = DecodeGraph(self.decoder, self.cache, size, self._pool)
        return self._graphs[size].run(tokens, positions, lengths)

    def _decode(self, size: int, tokens, positions, lengths) -> torch.Tensor:
        return self.decoder.decode(tokens, positions, lengths, self.cache, size)

    def collect(self, steps: int) -> list[Row]:
        """The interval's tokens into the rows' choices (the host's one sync) -> the rows that
        stopped: a stop token, a stop string (the choice is cut after it), max_tokens, the
        context."""
        counts, stopped, tokens, logprobs = self.state.read(steps)
        now = time.perf_counter()
        finished = []
        for p, row in enumerate(self.rows):
            request, k = row.request, counts[p]
            choice = request.choices[row.index]
            before = len(choice.token_ids)
            if not before and k and "first_token" not in request.times:
                request.times["first_token"] = now
            choice.token_ids += tokens[p][:k]
            choice.logprobs += logprobs[p][:k]
            row.generated += k
            reason = None
            if request.stop_check is not None:
                reason = _stop_string(request, choice, before)
                row.generated = len(choice.token_ids)
            if reason is None and stopped[p]:
                params = request.params
                stop = not params.ignore_eos and choice.token_ids[-1] in params.stop_token_ids
                reason = "stop" if stop else "length"
            if reason is not None:
                choice.finish_reason = reason
                finished.append(row)
        live = sum(counts)
        self.stats.tokens += live
        self.stats.rows += live
        return finished

    def retire(self, gone: list[Row], finished: bool = True) -> None:
        """Rows leave the batch: their blocks go back, the others move to the front.
        finished: their choices are complete (False: preempted, they run again)."""
        if not gone:
            return
        if self.journal is not None and finished:
            self.journal.append([r.uid for r in gone])
        gone_ids = {id(r) for r in gone}
        keep = [p for p, r in enumerate(self.rows) if id(r) not in gone_ids]
        self.cache.release([p for p, r in enumerate(self.rows) if id(r) in gone_ids])
        self.cache.compact(keep)
        self.cache.upload()
        self.state.reorder(keep)
        for row in gone:
            request = row.request
            if not finished or request.done:
                continue
            if request.cancelled:
                self.stats.cancelled += 1
                request.fail(RequestRefused("cancelled", "the client went away"))
            else:
                request.choice_done()
        self.rows = [self.rows[p] for p in keep]
        if self._logits is not None:
            index = _on(torch.tensor(keep, dtype=torch.long), self.device)
            self._logits = self._logits.index_select(0, index) if keep else None

    def drop(self, rows: list[Row], error: RequestRefused) -> None:
        """Rows whose requests failed: out of the batch, the requests told why."""
        rows = list(rows)
        for row in rows:
            row.request.fail(error)
        self.retire(rows)

    def grow(self, steps: int) -> list[Row]:
        """Blocks for every row's next `steps` tokens -> the rows preempted for them (the last
        admitted give way when the cache is full; the caller queues them again)."""
        cache, preempted = self.cache, []
        need = [r.prompt_len + r.generated + steps for r in self.rows]
        while cache.missing(need) > cache.free_blocks and len(self.rows) > 1:
            request = self.rows[-1].request
            members = [r for r in self.rows if r.request is request]
            if len(members) == len(self.rows):
                members = members[-1:]  # one request alone: its last choices give way
            self.retire(members, finished=False)
            for row in members:
                row.restart()
            preempted = members + preempted
            need = [r.prompt_len + r.generated + steps for r in self.rows]
        self.stats.preempted += len(preempted)
        free = cache.free_blocks
        cache.grow(need)
        if cache.free_blocks != free:  # a row took a block: the device's table changes
            cache.upload()
        return preempted


def new_cache(policy, decoder: Decoder, rows: int, context_tokens: int, cache_tokens: int):
    """`cache_tokens` tokens of blocks; 0: half of the free GPU memory (on a CPU: every row's
    whole context); never more than every row's whole context."""
    worst = rows * blocks_for(context_tokens) + 1
    if cache_tokens:
        blocks = min(worst, blocks_for(cache_tokens) + 1)
    elif policy.device.type != "cuda":
        blocks = worst
    else:
        d = decoder.dims
        per_block = BLOCK * KVCache.bytes_per_token(
            len(decoder.layers), d.kv_heads, d.head_dim, policy.dtype
        )
        free, _ = torch.cuda.mem_get_info(policy.device)
        states = (rows + 1) * HybridDecoder.state_bytes_per_row(decoder, policy.dtype)
        blocks = min(worst, (int(free * _CACHE_MEMORY_SHARE) - states) // per_block)
    if blocks - 1 < blocks_for(context_tokens):
        raise ValueError(
            f"a KV cache of {blocks - 1} blocks of {BLOCK} tokens cannot hold one row of "
            f"{context_tokens} tokens: raise generation.kv_cache_tokens or lower "
            "generation.server.context_tokens"
        )
    return decoder.new_cache(
        blocks=blocks, rows=rows, max_len=context_tokens, dtype=policy.dtype,
        device=policy.device,
    )  # fmt: skip


def prompt_key(request: Request) -> object:
    """What makes two requests' prompts one prefill: the ids of a text prompt; the Prompt
    object of one with media (the server's prompt cache hands identical requests one object:
    rlflow/serve/prompts.py)."""
    media = request.prompt.media
    if media.num_images or media.num_videos:
        return id(request.prompt)
    return tuple(request.prompt_ids)


def _stop_string(request: Request, choice: Choice, before: int) -> str | None:
    """ "stop" when a stop string ends in the tokens after `before` (the choice is cut after
    the first token that completes one), else None."""
    for end in range(before + 1, len(choice.token_ids) + 1):
        if request.stop_check(choice.token_ids[:end]):
            del choice.token_ids[end:], choice.logprobs[end:]
            return "stop"
    return None


def _on(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on the device without waiting for the device's queue (pinned, async)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
