"""Tensor-parallel shards of one weight, as the two sides of a weight sync hold them.

Pure tensor code (no process group): where a trainer shard's rows land in a generation shard
when the two sides' tensor-parallel sizes differ, and a fingerprint of a whole tensor
(rlflow.model.fingerprint) that each side computes from its own shards, so the two can be
compared without gathering anything.

megatron-core splits a tensor-parallel weight along `partition_dim` into `tp` contiguous
chunks, one per rank, except for fused weights, split part by part: a gated MLP's [gate; up]
(`partition_stride` 2, equal parts), so rank r holds [gate_r; up_r]; a Mamba mixer's in_proj
[z; x; B; C; dt] and conv1d [x; B; C] (`partition_sizes`: each part's rows on one rank, unequal
parts). A `Layout` states this once:

    full tensor, along dim:  | part 0 (S0 rows)             | part 1 (S1 rows)             |
    shard r of tp:           | part 0 rows r*c0 .. r*c0+c0  | part 1 rows r*c1 .. r*c1+c1  |   cp = Sp/tp
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlflow.model import fingerprint


@dataclass(frozen=True)
class Layout:
    """One weight as the trainer and the generation engine both hold it."""

    name: str
    shape: tuple[int, ...]  # the whole tensor (all tensor-parallel shards together)
    dtype: str
    dim: int | None  # tensor-parallel partition dim; None: every rank holds the whole tensor
    parts: int  # megatron's partition_stride: 2 for a gated MLP's [gate; up]
    expert: int = -1  # a routed expert's weight: the training EP rank that holds it; -1: none
    # unequal parts (megatron's partition_sizes, a Mamba mixer's in_proj and conv1d): each
    # part's rows in the whole tensor; empty: `parts` equal parts
    part_sizes: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.dim] //= tp
        return tuple(shape)

    def spans(self) -> list[tuple[int, int]]:
        """(first row, rows) of each part in the whole tensor, along dim."""
        sizes = self.part_sizes or (self.shape[self.dim] // self.parts,) * self.parts
        starts = [sum(sizes[:p]) for p in range(len(sizes))]
        return list(zip(starts, sizes))


def layout_of(name: str, param: torch.Tensor, tp: int) -> Layout:
    """The Layout of a megatron-core parameter held by a rank of a `tp`-way group."""
    parallel = bool(getattr(param, "tensor_model_parallel", False))
    dim = int(param.partition_dim) if parallel else None
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= tp
    parts = int(getattr(param, "partition_stride", 1)) if dim is not None else 1
    sizes = getattr(param, "partition_sizes", None) if dim is not None else None
    if sizes:  # one rank's rows of each part: the whole tensor's are tp times as many
        sizes = tuple(int(size) * tp for size in sizes)
        parts = len(sizes)
    dtype = str(param.dtype).removeprefix("torch.")
    return Layout(name, tuple(shape), dtype, dim, parts, part_sizes=tuple(sizes or ()))


def copy_overlap(
    layout: Layout, src: torch.Tensor, src_rank: int, src_tp: int, dst: torch.Tensor, dst_rank: int, dst_tp: int
) -> int:  # fmt: skip
    """Copy the rows shard `src` (rank src_rank of src_tp) shares with shard `dst` (rank
    dst_rank of dst_tp) into `dst`, in place; return the number of elements copied."""
    if layout.dim is None:
        dst.copy_(src)
        return dst.numel()
    dim, copied = layout.dim, 0
    for start, size in layout.spans():
        cs, cd = size // src_tp, size // dst_tp  # the part's rows in one shard of each side
        s_lo, d_lo = start + src_rank * cs, start + dst_rank * cd
        lo, hi = max(s_lo, d_lo), min(s_lo + cs, d_lo + cd)
        if lo >= hi:
            continue
        # the part begins at row start / tp of a shard (every earlier part is split tp ways)
        piece = src.narrow(dim, start // src_tp + lo - s_lo, hi - lo)
        dst.narrow(dim, start // dst_tp + lo - d_lo, hi - lo).copy_(piece)
        copied += piece.numel()
    return copied


def overlaps(src_rank: int, src_tp: int, dst_tp: int) -> list[int]:
    """The dst ranks whose shard shares rows with shard src_rank (the same in every part)."""
    lo, hi = src_rank / src_tp, (src_rank + 1) / src_tp
    return [d for d in range(dst_tp) if d / dst_tp < hi and lo < (d + 1) / dst_tp]


# ---------------------------------------------------------------- fingerprints


def sample_positions(layout: Layout, version: int) -> torch.Tensor:
    """Flat indices into the whole tensor (rlflow.model.fingerprint.sample_positions)."""
    return fingerprint.sample_positions(layout.name, layout.numel, version)


def partial_checksum(
    layout: Layout, local: torch.Tensor, rank: int, tp: int, positions: torch.Tensor
) -> int:
    """This shard's share of the tensor's checksum: sum_k (k + 1) * bits(x[pos_k]) over the
    sampled positions this shard holds. Integer arithmetic: the shares of all shards add up to
    the same number however the tensor is split, exactly. A whole-tensor layout counts on rank
    0 only."""
    if layout.dim is None:
        if rank != 0:
            return 0
        mine, index = torch.ones(len(positions), dtype=torch.bool), positions
    else:
        mine, index = _local_index(layout, positions, rank, tp)
    if not bool(mine.any()):
        return 0
    flat = local.detach().reshape(-1)
    values = fingerprint.bits(flat[index[mine].to(flat.device)].cpu())
    weights = torch.arange(1, len(positions) + 1, dtype=torch.int64)[mine]
    return int((values * weights).sum())


def _local_index(
    layout: Layout, positions: torch.Tensor, rank: int, tp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(held by this shard?, flat index into the shard) for flat positions of the whole tensor."""
    coords = list(torch.unravel_index(positions, layout.shape))
    dim = layout.dim
    row = coords[dim]
    mine = torch.zeros_like(row, dtype=torch.bool)
    local = torch.zeros_like(row)
    for start, size in layout.spans():
        chunk = size // tp
        inside = (row >= start) & (row < start + size)
        offset = row - start
        mine |= inside & (offset // chunk == rank)
        local = torch.where(inside, start // tp + offset % chunk, local)
    coords[dim] = local
    shard = layout.shard_shape(tp)
    index = torch.zeros_like(positions)
    for size, coord in zip(shard, coords):
        index = index * size + coord
    return mine, index
