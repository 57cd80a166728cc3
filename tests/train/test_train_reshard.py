"""Resharding between tensor-parallel sizes and the weight fingerprint, on plain tensors.

The shards are cut the way megatron-core cuts them (contiguous chunks along partition_dim; a
stride-2 weight part by part), independently of rlflow.train.generation_role.reshard, and every pair of sizes
is checked against the directly cut target shard.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rlflow.train.generation_role.reshard import (
    Layout,
    copy_overlap,
    layout_of,
    overlaps,
    partial_checksum,
    sample_positions,
)


def megatron_shard(full: torch.Tensor, dim: int, stride: int, tp: int, rank: int):
    """megatron-core's _initialize_affine_weight_cpu: split into stride * tp chunks, rank r
    takes chunks r, r + tp, r + 2 tp, ..."""
    chunks = torch.split(full, full.shape[dim] // (stride * tp), dim=dim)
    return torch.cat(chunks[rank::tp], dim=dim)


CASES = [(dim, stride) for dim in (0, 1) for stride in (1, 2)]
SIZES = [1, 2, 4]


@pytest.mark.parametrize(("dim", "stride"), CASES)
@pytest.mark.parametrize(("src_tp", "dst_tp"), list(itertools.product(SIZES, SIZES)))
def test_every_target_shard_is_assembled_from_the_source_shards(dim, stride, src_tp, dst_tp):
    full = torch.arange(16 * 8, dtype=torch.float32).view(16, 8)
    layout = Layout("w", tuple(full.shape), "float32", dim, stride)
    for dst_rank in range(dst_tp):
        expected = megatron_shard(full, dim, stride, dst_tp, dst_rank)
        got = torch.full_like(expected, -1.0)
        copied = 0
        for src_rank in range(src_tp):
            src = megatron_shard(full, dim, stride, src_tp, src_rank)
            n = copy_overlap(layout, src, src_rank, src_tp, got, dst_rank, dst_tp)
            assert (n > 0) == (dst_rank in overlaps(src_rank, src_tp, dst_tp))
            copied += n
        assert torch.equal(got, expected)
        assert copied == expected.numel()  # every element once: no shard overlaps another


def test_a_whole_tensor_is_copied_as_is():
    layout = Layout("norm", (5,), "float32", None, 1)
    dst = torch.zeros(5)
    copy_overlap(layout, torch.arange(5.0), 0, 1, dst, 1, 2)
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(("dim", "stride"), CASES)
def test_the_fingerprint_does_not_depend_on_the_split(dim, stride):
    torch.manual_seed(0)
    full = torch.randn(16, 8)
    layout = Layout("decoder.layers.0.mlp.linear_fc1.weight", (16, 8), "float32", dim, stride)
    positions = sample_positions(layout, version=3)
    sums = {
        tp: sum(
            partial_checksum(layout, megatron_shard(full, dim, stride, tp, r), r, tp, positions)
            for r in range(tp)
        )
        for tp in SIZES
    }
    assert len(set(sums.values())) == 1 and sums[1] != 0


def test_the_fingerprint_sees_a_changed_element_and_a_new_version():
    layout = Layout("w", (64,), "float32", 0, 1)
    x = torch.randn(64)
    positions = sample_positions(layout, version=1)
    before = partial_checksum(layout, x, 0, 1, positions)
    y = x.clone()
    y[int(positions[5])] += 1e-3  # one sampled element, changed in its last bits
    assert partial_checksum(layout, y, 0, 1, positions) != before
    assert not torch.equal(positions, sample_positions(layout, version=2))  # other samples


def test_bf16_checksums_are_exact_integers():
    layout = Layout("w", (8, 4), "bfloat16", 1, 1)
    x = torch.randn(8, 4).to(torch.bfloat16)
    positions = sample_positions(layout, version=0)
    whole = partial_checksum(layout, x, 0, 1, positions)
    halves = [partial_checksum(layout, x[:, 2 * r : 2 * r + 2], r, 2, positions) for r in (0, 1)]
    assert whole == sum(halves)


def test_layout_of_reads_megatron_attributes():
    weight = torch.nn.Parameter(torch.zeros(6, 4))
    weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, 0, 2
    assert layout_of("fc1", weight, tp=2) == Layout("fc1", (12, 4), "float32", 0, 2)
    norm = torch.nn.Parameter(torch.zeros(4))
    assert layout_of("norm", norm, tp=2) == Layout("norm", (4,), "float32", None, 1)


# A Mamba mixer's in_proj, whole: [z; x; B; C; dt] rows of unequal sizes; megatron-core sets
# `partition_sizes` (one rank's rows of each part) and splits each part over the ranks.
MAMBA_PARTS = (8, 8, 4, 4, 4)


def megatron_parts_shard(full: torch.Tensor, sizes: tuple[int, ...], tp: int, rank: int):
    """Rank `rank`'s shard of a weight fused from parts of `sizes` rows (dim 0)."""
    parts = torch.split(full, list(sizes), dim=0)
    return torch.cat([torch.chunk(part, tp, dim=0)[rank] for part in parts], dim=0)


@pytest.mark.parametrize(("src_tp", "dst_tp"), list(itertools.product(SIZES, SIZES)))
def test_unequal_parts_reshard_and_fingerprint_alike(src_tp, dst_tp):
    """The Mamba weights CI's separate-placement runs synced wrong before Layout knew
    partition_sizes: each part is split over the ranks, not the fused tensor."""
    full = torch.randn(sum(MAMBA_PARTS), 3)
    layout = Layout("in_proj", tuple(full.shape), "float32", 0, 5, part_sizes=MAMBA_PARTS)
    for dst_rank in range(dst_tp):
        expected = megatron_parts_shard(full, MAMBA_PARTS, dst_tp, dst_rank)
        got = torch.full_like(expected, float("nan"))
        for src_rank in range(src_tp):
            src = megatron_parts_shard(full, MAMBA_PARTS, src_tp, src_rank)
            copy_overlap(layout, src, src_rank, src_tp, got, dst_rank, dst_tp)
        assert torch.equal(got, expected)
    positions = sample_positions(layout, version=1)
    sums = {
        tp: sum(
            partial_checksum(
                layout, megatron_parts_shard(full, MAMBA_PARTS, tp, r), r, tp, positions
            )
            for r in range(tp)
        )
        for tp in (src_tp, dst_tp)
    }
    assert len(set(sums.values())) == 1


def test_layout_of_reads_partition_sizes():
    weight = torch.nn.Parameter(torch.zeros(14, 3))
    weight.tensor_model_parallel, weight.partition_dim = True, 0
    weight.partition_sizes = [4, 4, 2, 2, 2]
    expected = Layout("in_proj", (28, 3), "float32", 0, 5, part_sizes=(8, 8, 4, 4, 4))
    assert layout_of("in_proj", weight, tp=2) == expected
