"""The decode KV cache: keys and values in fixed-size blocks, handed to rows as they grow.

A GRPO rollout set is 512 rows whose lengths nobody knows in advance: most stop after a few
hundred tokens, a few run to the cap. A cache of [rows, cap] reserves every row's worst case,
so at a 4096 cap one H200 fits a third of the rows and the rollout runs in three passes, each as
long as its longest row. Here (vLLM's paged attention, in its simplest form) each layer's keys
and values are one pool of `BLOCK`-token blocks, and a block table maps row r's token j to
block table[r, j // BLOCK], slot j % BLOCK. Rows take blocks as they grow and give them back
when they stop, so the cache holds what rows use, not what they might.

* The host does the book-keeping, without syncing the GPU: every live row grows by exactly one
  token per decode step, so the engine knows each row's length from its prompt and the step.
  It grows the table a few steps ahead at the engine's stop checks and uploads it (a few KB).
* Block 0 is scratch: every table entry that no row owns points at it. Rows that stopped but
  still pad a CUDA-graph batch, and the graphs' warm-up steps, write there, never into a live
  row. The table's last column is always scratch (a row never grows into it), and `length`
  (the table's span) is what a warm-up step writes at: its last slot.
* Retiring rows reorders table rows only: no key or value moves.
* When the pool runs out, the engine preempts rows (it frees their blocks; they run again
  from their prompt in a later pass, with the same seeds: rlflow/generation/megatron/schedule.py).

`BLOCK` equals the decode kernel's key tile (rlflow/generation/megatron/flash_decode.py): one tile reads
one block.
"""

from __future__ import annotations

import torch

BLOCK = 64  # tokens per block


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


class KVCache:
    """Per-layer pools keys/values [blocks, BLOCK, kv_heads, head_dim] (keys stored rotated), a
    block table [rows, max_blocks] on the device, and its host copy with the free list."""

    def __init__(
        self, num_layers: int, *, blocks: int, rows: int, max_len: int, kv_heads: int,
        head_dim: int, dtype, device,
    ):  # fmt: skip
        if blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (1 is scratch), got {blocks}")
        self.blocks, self.rows = blocks, rows
        self.max_blocks = blocks_for(max_len) + 1  # + the scratch column
        self.length = self.max_blocks * BLOCK  # the span a table row addresses
        shape = (blocks, BLOCK, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.table = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=device)
        self._host = torch.zeros(rows, self.max_blocks, dtype=torch.int32)
        self._owned = [0] * rows  # blocks row position p owns: table[p, :owned[p]]
        self._free = list(range(blocks - 1, 0, -1))  # a stack; block 0 is scratch

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def missing(self, tokens: list[int]) -> int:
        """Blocks still to hand out so that position p holds tokens[p] tokens."""
        return sum(max(0, self._need(t) - self._owned[p]) for p, t in enumerate(tokens))

    def grow(self, tokens: list[int]) -> None:
        """Position p gets blocks for tokens[p] tokens (the caller checked `missing`)."""
        for p, t in enumerate(tokens):
            need = self._need(t)
            while self._owned[p] < need:
                self._host[p, self._owned[p]] = self._free.pop()
                self._owned[p] += 1

    def _need(self, tokens: int) -> int:
        return min(blocks_for(tokens), self.max_blocks - 1)  # never the scratch column

    def release(self, positions) -> None:
        """Positions give their blocks back; their table rows point at scratch."""
        for p in positions:
            self._free.extend(self._host[p, : self._owned[p]].tolist())
            self._host[p, : self._owned[p]] = 0
            self._owned[p] = 0

    def release_all(self) -> None:
        self._host.zero_()
        self._owned = [0] * self.rows
        self._free = list(range(self.blocks - 1, 0, -1))

    def compact(self, order: list[int]) -> None:
        """Positions order[0..n-1] move to the front; every other position must hold no block."""
        kept = set(order)
        assert all(self._owned[p] == 0 for p in range(self.rows) if p not in kept)
        n = len(order)
        self._host[:n] = self._host[order].clone()
        self._host[n:] = 0
        owned = [self._owned[p] for p in order]
        self._owned = owned + [0] * (self.rows - n)

    def upload(self) -> None:
        """The host table to the device (in stream order: no sync)."""
        source = self._host.pin_memory() if self.table.is_cuda else self._host
        self.table.copy_(source, non_blocking=True)

    def slots(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Flat slots (block * BLOCK + j % BLOCK) of token offsets[i] of row position rows[i]."""
        blocks = self.table[rows, offsets // BLOCK].long()
        return blocks * BLOCK + offsets % BLOCK
