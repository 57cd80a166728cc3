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

TINY_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"


def leftover_weight_files(backend) -> list[Path]:
    """Weight files this test process's backends left on node-local storage (should be none)."""
    root = Path(backend._weights_root or tempfile.gettempdir())
    return list(root.glob(f"rlflow-vllm-weights-{os.getpid()}-*"))


@pytest.fixture(scope="session")
def vllm_gen_cfg():
    """The tiny CPU recipe's generation section with backend=vllm, on the CPU pin set."""
    from rlflow.recipe import load_checked

    gen = load_checked(TINY_RECIPE, ["generation.backend=vllm"]).recipe.generation
    return replace(gen, vllm=replace(gen.vllm, device="cpu"))


@pytest.fixture(scope="session")
def vllm_env(vllm_gen_cfg):
    from rlflow.envs.build import ensure_env
    from rlflow.envs.spec import vllm_spec

    cfg = vllm_gen_cfg.vllm
    return ensure_env(vllm_spec(cfg), cfg.env_root)


@pytest.fixture
def start_vllm(vllm_env, vllm_gen_cfg, tmp_path):
    """Start VLLMGeneration backends for one test; every one is closed (by PID) afterwards."""
    from rlflow.generation.vllm import VLLMGeneration

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
