"""Stable seeds from parts: the same (seed, name, index) gives the same stream on every machine,
Python version and PYTHONHASHSEED (hash() of a str is salted per process; sha256 is not)."""

from __future__ import annotations

import hashlib
import random


def derive_seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def row_rng(seed: int, kind: str, index: int) -> random.Random:
    """The generator for one synthetic row; rows are independent, so access order is free."""
    return random.Random(derive_seed("rlflow-data", seed, kind, index))
