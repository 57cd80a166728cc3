"""The serving engine's running batch: its rows, their KV cache blocks and next-token logits.

Used by rlflow/serve/engine.py (which explains the loop). Rows sit at batch positions 0..n-1;
position p owns block-table row p of the paged cache (rlflow/generation/megatron/kv_cache.py). New rows
are prefilled behind the running ones; rows that leave give their blocks back and the others
move to the front (block-table rows only, no key or value moves).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlflow.generation.megatron.decoder import DecodeGraph, Decoder
from rlflow.generation.megatron.engine import batch_buckets
from rlflow.generation.megatron.kv_cache import BLOCK, KVCache, blocks_for
from rlflow.generation.megatron.prefill import packed_prompts, prefill_slots
from rlflow.generation.megatron.sampling import sample_tokens
from rlflow.serve.requests import Choice, Request, RequestRefused

_CACHE_MEMORY_SHARE = 0.5  # of free GPU memory, as generate()'s cache


@dataclass(eq=False)
class Row:
    """One choice of a request while it is in the batch (or waits to be)."""

    request: Request
    index: int  # which choice
    prompt_len: int
    next_pos: int = 0  # the text position of the first generated token (set by the prefill)
    generated: int = 0
    last: int = 0  # the last sampled token

    @property
    def seed(self) -> int:
        return self.request.seeds[self.index]

    def restart(self) -> None:
        """Preempted: it runs again from its prompt (same seed, same tokens)."""
        self.generated, self.last = 0, 0
        self.request.choices[self.index] = Choice()


@dataclass
class Stats:
    """Decode steps, rows summed over them (mean occupancy = rows / steps), tokens, preemptions."""

    steps: int = 0
    rows: int = 0
    tokens: int = 0
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
        self.decoder = Decoder(self.core, compile_decode=compile_decode and graphs)
        self.cache = new_cache(policy, self.decoder, max_rows, context_tokens, cache_tokens)
        self._graphs: dict[int, DecodeGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self._buckets = batch_buckets(max_rows) if graphs else None
        self.rows: list[Row] = []  # in position order
        self._logits: torch.Tensor | None = None  # [rows, V]: each row's next-token logits
        self.stats = Stats()

    def prefill(self, new: list[Row], weight_version: int) -> None:
        """New rows join behind the running ones: their unique prompts (a request's choices,
        identical text prompts) prefilled once, packed, into the new rows' blocks."""
        unique: dict[object, int] = {}  # a prompt's key -> its slot in the pack
        prompts, ids, slot = [], [], []
        for row in new:
            request = row.request
            key = tuple(request.prompt_ids) if not _has_media(request) else id(request)
            if key not in unique:
                unique[key] = len(prompts)
                prompts.append(request.prompt)
                ids.append(request.prompt_ids)
            slot.append(unique[key])
            if request.weight_version < 0:
                request.weight_version = weight_version
        first = len(self.rows)
        self.cache.grow([0] * first + [r.prompt_len + 1 for r in new])
        self.cache.upload()
        decoder, device = self.decoder, self.device
        pack, attend, inputs, cos, sin, next_pos = packed_prompts(
            self.core, prompts, ids, sum(len(i) for i in ids), decoder=decoder,
            policy=self.policy, pad_token_id=self.pad_token_id, device=device,
        )  # fmt: skip
        row_slot = torch.tensor(slot, dtype=torch.long, device=device)
        dest, src = prefill_slots(pack, row_slot, self.cache, first)
        hidden = decoder.prefill(
            inputs.hidden, cos, sin, attend, self.cache, dest, src, deepstack=inputs.deepstack
        )
        last = pack.cu_seqlens[1:].long()[: len(prompts)] - 1
        logits = decoder.logits(hidden.index_select(0, last)).index_select(0, row_slot)
        next_pos = next_pos.tolist()
        for row, s in zip(new, slot):
            row.next_pos = next_pos[s]
        self.rows += new
        self._logits = logits if self._logits is None else torch.cat([self._logits, logits])
        self.stats.prefills += 1

    def sample(self) -> list[Row]:
        """One token per row, with its request's parameters -> the rows that stopped."""
        rows, logits, device = self.rows, self._logits, self.device
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):
            p = row.request.params
            groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(i)
        seeds = torch.tensor([r.seed for r in rows], dtype=torch.long, device=device)
        steps = torch.tensor([r.generated for r in rows], dtype=torch.long, device=device)
        if len(groups) == 1:
            tokens, logprobs = sample_tokens(logits, rows[0].request.params, seeds, steps)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=device)
            logprobs = torch.empty(len(rows), dtype=logits.dtype, device=device)
            for members in groups.values():
                index = torch.tensor(members, dtype=torch.long, device=device)
                params = rows[members[0]].request.params
                t, lp = sample_tokens(logits[index], params, seeds[index], steps[index])
                tokens[index], logprobs[index] = t, lp
        finished = []
        for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
            choice = row.request.choices[row.index]
            choice.token_ids.append(token)
            choice.logprobs.append(logprob)
            row.generated += 1
            row.last = token
            reason = self._stop_reason(row, choice)
            if reason is not None:
                choice.finish_reason = reason
                finished.append(row)
        self.stats.tokens += len(rows)
        return finished

    def _stop_reason(self, row: Row, choice: Choice) -> str | None:
        request, params = row.request, row.request.params
        if not params.ignore_eos and choice.token_ids[-1] in params.stop_token_ids:
            return "stop"
        if request.stop_check is not None and request.stop_check(choice.token_ids):
            return "stop"
        if row.generated >= params.max_new_tokens:
            return "length"
        if row.prompt_len + row.generated >= self.context_tokens:
            return "length"
        return None

    def retire(self, gone: list[Row], finished: bool = True) -> None:
        """Rows leave the batch: their blocks go back, the others move to the front.
        finished: their choices are complete (False: preempted, they run again)."""
        if not gone:
            return
        gone_ids = {id(r) for r in gone}
        keep = [p for p, r in enumerate(self.rows) if id(r) not in gone_ids]
        self.cache.release([p for p, r in enumerate(self.rows) if id(r) in gone_ids])
        self.cache.compact(keep)
        self.cache.upload()
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
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            self._logits = self._logits.index_select(0, index) if keep else None

    def drop(self, rows: list[Row], error: RequestRefused) -> None:
        """Rows whose requests failed: out of the batch, the requests told why."""
        rows = list(rows)
        for row in rows:
            row.request.fail(error)
        self.retire(rows)

    def grow(self) -> list[Row]:
        """Blocks for every row's next token -> the rows preempted for them (the last admitted
        give way when the cache is full; the caller queues them again)."""
        cache, preempted = self.cache, []
        need = [r.prompt_len + r.generated + 1 for r in self.rows]
        while cache.missing(need) > cache.free_blocks and len(self.rows) > 1:
            request = self.rows[-1].request
            members = [r for r in self.rows if r.request is request]
            if len(members) == len(self.rows):
                members = members[-1:]  # one request alone: its last choices give way
            self.retire(members, finished=False)
            for row in members:
                row.restart()
            preempted = members + preempted
            need = [r.prompt_len + r.generated + 1 for r in self.rows]
        self.stats.preempted += len(preempted)
        free = cache.free_blocks
        cache.grow(need)
        if cache.free_blocks != free:  # a row took a block: the device's table changes
            cache.upload()
        return preempted

    def decode(self) -> None:
        """One decode step of every row: the logits of each row's next token."""
        rows, device = self.rows, self.device
        n = len(rows)
        size = next(b for b in self._buckets if b >= n) if self._buckets else n
        pad = size - n
        tokens = torch.tensor([r.last for r in rows] + [0] * pad, device=device)
        positions = [r.next_pos + r.generated - 1 for r in rows]
        positions = torch.tensor(positions + [0] * pad, device=device)
        lengths = [r.prompt_len + r.generated for r in rows]
        lengths = torch.tensor(lengths + [1] * pad, device=device)
        if self._buckets:
            if size not in self._graphs:
                self._graphs[size] = DecodeGraph(self.decoder, self.cache, size, self._pool)
            self._logits = self._graphs[size].run(tokens, positions, lengths)[:n]
        else:
            self._logits = self.decoder.decode(tokens, positions, lengths, self.cache, n)
        self.stats.steps += 1
        self.stats.rows += n


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
        blocks = min(worst, int(free * _CACHE_MEMORY_SHARE) // per_block)
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


def _has_media(request: Request) -> bool:
    media = request.prompt.media
    return bool(media.num_images or media.num_videos)
