"""Session-wide fixtures: one single-rank megatron-core parallel state and a tiny checkpoint."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def single_rank():
    """torch.distributed (gloo, world 1) + megatron parallel state, once per test process."""
    from rlflow import parallel
    from rlflow.model.compat import library_logs
    from tests.tiny import SINGLE

    library_logs.quiet()
    return parallel.init_parallel(SINGLE, seed=1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from tests.tiny import tiny_checkpoint

    return tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def tiny_policy(single_rank, tiny_ckpt):
    """The tiny checkpoint as a frozen Megatron policy (fp32)."""
    from rlflow.model.build import load_policy
    from tests.tiny import FP32, SINGLE

    return load_policy(tiny_ckpt, FP32, SINGLE, trainable=False)


@pytest.fixture(scope="session")
def tiny_processor(tiny_ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_ckpt))
