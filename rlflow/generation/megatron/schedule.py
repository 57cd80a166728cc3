"""Which rollout rows a generation pass runs, and which rows give way when the KV cache is full.

The engine (rlflow/generation/megatron/engine.py) runs the rollout set in passes. A pass starts with
the rows `admit` picks: whole prompt groups (a prompt's samples share one prefill), while each
row's prompt plus a quarter of the cap fits in the free cache blocks (a group too large for the
whole cache is split)
(rlflow/generation/megatron/kv_cache.py). Rows then take blocks as they grow. `Batch` is the host's view
of a pass's decode batch: which output row sits at each batch position, how long it is, which
ones are alive. At every stop check it frees the blocks of rows that stopped, and when the
blocks for the next steps are not there, it preempts live rows, the last admitted first, never
the last one: they leave the pass and run again from their prompt in a later pass. A row's
draws depend on its seed and step only (rlflow/generation/megatron/sampling.py), so a preempted row
gets the same tokens when it runs again, up to what a different batch changes in the matmuls'
rounding (as for passes of different sizes); the work it had done is the price.
"""

from __future__ import annotations

from rlflow.generation.megatron.kv_cache import KVCache, blocks_for

RESERVE_SHARE = 4  # a row is admitted with room for its prompt + 1/4 of the cap


def admit(
    pending: list[int], prompt_len: list[int], row_prompt: list[int], *, free_blocks: int,
    max_rows: int, reserve: int, max_len: int,
) -> list[int]:  # fmt: skip
    """Rows of the next pass: whole prompt groups from the front of `pending` (row ids in
    order), while each row's prompt_len + reserve tokens (at most max_len) fit in
    `free_blocks` and the pass has at most `max_rows` rows (0: no cap). The first group is
    always admitted: whole where it fits in the cache, else as many of its rows as fit (one
    at least)."""
    groups: dict[int, list[int]] = {}
    for r in pending:
        groups.setdefault(row_prompt[r], []).append(r)
    rows: list[int] = []
    used = 0
    for members in groups.values():
        each = blocks_for(min(prompt_len[members[0]] + reserve, max_len))
        if not rows:
            fits = max(1, free_blocks // each)
            if len(members) > fits:
                return members[:fits]
        elif used + len(members) * each > free_blocks or (
            max_rows and len(rows) + len(members) > max_rows
        ):
            break
        rows += members
        used += len(members) * each
    return rows


class Batch:
    """The host's copy of a pass's decode batch (no GPU sync needed to keep it).

    Position p holds output row out[p] (or `trash`: padding up to the batch bucket) whose key
    count at decode step s is start[p] + s + 1: every position grows by one token a step."""

    def __init__(self, prompt_lengths: list[int], capacity: int, ahead: int):
        n = len(prompt_lengths)
        self.trash = n
        self.out = list(range(n)) + [n] * (capacity - n)
        self.start = list(prompt_lengths) + [0] * (capacity - n)
        self.alive = [True] * n + [False] * (capacity - n)
        self.ahead = ahead  # steps between two checks (+1): what a check must cover
        self.preempted: list[int] = []  # output rows that left the pass

    def first_blocks(self, cache: KVCache) -> None:
        """The prompts' blocks plus room for the steps before the first check."""
        cache.release_all()
        cache.grow(self._need(-1))
        cache.upload()

    def check(self, cache: KVCache, step: int, alive: list[bool]) -> list[int]:
        """At decode step `step`'s check: free the blocks of rows that stopped, preempt live rows
        until the next steps' blocks are there, grow the rest. Returns the preempted positions
        (the caller marks them finished on the device)."""
        self.alive = [a and self.out[p] != self.trash for p, a in enumerate(alive)]
        cache.release([p for p, a in enumerate(self.alive) if not a])
        need = self._need(step)
        victims = []
        while cache.missing(need) > cache.free_blocks:
            live = [p for p, a in enumerate(self.alive) if a]
            if len(live) <= 1:  # the cache holds one full row (the engine checks at creation)
                raise RuntimeError("the KV cache cannot hold one row; this is a bug")
            victim = max(live, key=lambda p: self.out[p])
            self.alive[victim], need[victim] = False, 0
            cache.release([victim])
            victims.append(victim)
            self.preempted.append(self.out[victim])
        return victims

    def compact(self, cache: KVCache, size: int) -> list[int]:
        """Live positions first, then the rest, cut to `size`: the new batch order."""
        order = [p for p, a in enumerate(self.alive) if a]
        order = (order + [p for p, a in enumerate(self.alive) if not a])[:size]
        cache.compact(order)
        self.out = [self.out[p] for p in order]
        self.start = [self.start[p] for p in order]
        self.alive = [self.alive[p] for p in order]
        return order

    def grow(self, cache: KVCache, step: int) -> None:
        cache.grow(self._need(step))
        cache.upload()

    def _need(self, step: int) -> list[int]:
        """Tokens each live position needs through the next check (decode steps step..)."""
        return [s + step + 1 + self.ahead if a else 0 for s, a in zip(self.start, self.alive)]
