"""A cheap fingerprint of a weight tensor: the bits of a few sampled elements.

Two copies of a model's weights (the trainer's and a generation engine's) are compared after
every weight sync without moving the weights again: each side reads the same elements, drawn
from the tensor's name and the weights' version, so every sync checks other elements. Bits,
not values: an exact comparison, and integer sums of them add up the same however a tensor is
split into shards (rlflow.train.generation_role.reshard).
"""

from __future__ import annotations

import hashlib

import torch

# Sampled elements per tensor, besides its first and last element.
SAMPLES = 16
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sample_positions(name: str, numel: int, version: int) -> torch.Tensor:
    """Flat indices into a tensor of `numel` elements: its first and last element and SAMPLES
    more, drawn from its name and the weights' version (both sides draw the same ones)."""
    digest = hashlib.sha256(f"{name}@{version}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    drawn = torch.randint(0, numel, (SAMPLES,), generator=generator)
    return torch.cat([torch.tensor([0, numel - 1]), drawn])


def bits(values: torch.Tensor) -> torch.Tensor:
    """Each element's bit pattern as a non-negative int64 (float32, bf16, fp16, ...)."""
    values = values.detach().contiguous()
    return values.view(_BITS[values.element_size()]).to(torch.int64) & 0xFFFFFFFF
