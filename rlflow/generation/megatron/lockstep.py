"""Expert-parallel generation in lockstep: what the EP ranks of a mixture-of-experts model agree
on so that every rank runs the same MoE collectives (rlflow/generation/megatron/moe_decode.py).

Each EP rank generates its own rollouts (its data-parallel share), but every MoE layer of every
prefill and decode step all-gathers the tokens of all EP ranks and reduce-scatters their expert
outputs back: the ranks must run the same number of passes, prefills of the same token count
and decode steps of the same batch size, and stop together. So they agree, with one small
all-reduce (MAX) each time, on

* the number of passes (a rank with fewer runs empty passes, with no rows of its own);
* per pass: the packed prefill length (shorter ranks append a padding sequence) and the rows
  (fewer rows are padded with finished ones, which the engine already supports);
* at every stop check: the number of live rows (the batch shrinks to the largest rank's
  bucket; all ranks leave when no rank has a live row).

Without expert parallelism (or for a dense model) `Lockstep.of` gives an inactive one whose
`max` returns its arguments: the engine's single-rank behaviour is unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Lockstep:
    def __init__(self, group, device):
        self.group = group  # the expert-parallel process group, or None
        self.device = device

    @staticmethod
    def of(decoder, device) -> Lockstep:
        moe = next((w for w in decoder.moe_layers if w is not None), None)
        return Lockstep(None if moe is None else moe.ep_group, device)

    @property
    def active(self) -> bool:
        return self.group is not None

    def max(self, *values: int) -> list[int]:
        """The largest of each value over the expert-parallel ranks (one collective)."""
        if self.group is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()
