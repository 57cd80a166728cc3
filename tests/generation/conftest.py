"""Fixtures for the vLLM backend tests: its real environment (built once per machine) and config.

The environment is the one `rlflow setup-env vllm` builds, under the base recipe's env_root
(~/.cache/rlflow/envs): the first test session on a machine builds it (about 80 s of pip on an
idle 2-core machine, 2.5 GB), every later one, from any clone, reuses it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest


def leftover_weight_files(backend) -> list[Path]:
    """Weight files this test process's backends left on node-local storage (should be none)."""
    root = Path(backend._weights_root or tempfile.gettempdir())
    return list(root.glob(f"rlflow-vllm-weights-{os.getpid()}-*"))


@pytest.fixture
def start_vllm(vllm_env, vllm_gen_cfg, tmp_path):
    """Start VLLMGeneration backends for one test; every one is closed (by PID) afterwards."""
    from rlflow.generation.vllm.client import VLLMGeneration

    started = []

    def start(policy, **vllm_overrides):
        cfg = replace(vllm_gen_cfg, vllm=replace(vllm_gen_cfg.vllm, **vllm_overrides))
        backend = VLLMGeneration(policy, cfg, tmp_path / f"run{len(started)}", max_model_len=1024)
        started.append(backend)
        return backend

    yield start
    for backend in started:
        backend.close()
        assert not backend.worker.alive()
