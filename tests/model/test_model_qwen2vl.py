"""Qwen2-VL, the second vision-language family, added through rlflow/model/family.py only
(rlflow/model/families/qwen2vl.py, one registry line, one recipe): it loads through megatron-bridge with
rlflow's bridge registration, and matches HF in the forward, in export and in generation (packed
prefill, shared prompts and the vision cache included), packs like the padded path, and trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlflow.generation.base import SamplingParams
from tests.tiny import FP32, SINGLE, hf_logits_gap, megatron_generation, mixed_prompts

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen2vl(single_rank, tmp_path_factory):
    """(checkpoint, policy, processor, HF model); lm_head scaled so greedy has no near-ties."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from rlflow.model import family
    from rlflow.model.build import load_policy

    path = family.by_builtin("tiny-qwen2vl").write_tiny(
        tmp_path_factory.mktemp("qwen2vl"), "tiny-qwen2vl", seed=0, lm_head_scale=8.0
    )
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    processor = AutoProcessor.from_pretrained(str(path))
    hf = Qwen2VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, policy, processor, hf


def test_the_family_is_found_by_builtin_name_and_by_checkpoint(qwen2vl):
    from rlflow.model import family

    path, policy, _, _ = qwen2vl
    assert json.loads((path / "config.json").read_text())["architectures"] == [
        "Qwen2VLForConditionalGeneration"
    ]
    assert family.of_checkpoint(path) is family.by_builtin("tiny-qwen2vl") is policy.family
    assert policy.family.multimodal
    assert type(policy.core).__name__ == "Qwen2VLModel"
    assert type(policy.core.visual).__name__ == "Qwen2VisionTransformerPretrainedModel"


def test_logits_match_hf_for_a_left_padded_mixed_batch(qwen2vl):
    _, policy, processor, hf = qwen2vl
    prompts = mixed_prompts(processor)  # image, text only, video, image
    assert hf_logits_gap(hf, policy, prompts, processor.tokenizer.pad_token_id) < 1e-4


def test_export_round_trip_is_exact(qwen2vl):
    from safetensors import safe_open

    from rlflow.model.build import export_hf_state_dict

    path, policy, _, _ = qwen2vl
    exported = export_hf_state_dict(policy)
    with safe_open(str(path / "model.safetensors"), "pt") as disk:
        assert set(exported) == set(disk.keys())
        for name in disk.keys():
            assert torch.equal(exported[name], disk.get_tensor(name)), name


@pytest.mark.parametrize("shared", [False, True], ids=["one-row-per-prompt", "shared-prompts"])
def test_generation_matches_the_hf_backend(qwen2vl, shared):
    """Tokens identical, logprobs within 1e-4 (fp32, CPU). Shared: each prompt's rows are one
    object, so the engine prefills it once (packed) and the vision cache runs its tower once."""
    from rlflow.generation.hf import HFGeneration
    from rlflow.model.vision_cache import VisionCache

    _, policy, processor, _ = qwen2vl
    unique = mixed_prompts(processor)
    prompts = [p for p in unique for _ in range(2)] if shared else unique
    pad, eos = processor.tokenizer.pad_token_id, processor.tokenizer.eos_token_id
    params = SamplingParams(16, 0.0, 1.0, 0, 0, (eos,), True)
    kept = policy.vision_cache
    policy.vision_cache = cache = VisionCache(enabled=shared)
    try:
        ours = megatron_generation(policy, pad, max_batch_size=8, share_prompts=shared)
        ours = ours.generate(prompts, params)
    finally:
        policy.vision_cache = kept
    ref = HFGeneration(policy, pad, 8).generate(prompts, params)
    for prompt, a, b in zip(prompts, ours, ref):
        assert a.token_ids == b.token_ids, prompt.sample_id
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4, prompt.sample_id
    if shared:
        assert cache.computed == sum(1 for p in unique if p.media.num_images or p.media.num_videos)


def test_packed_logprobs_equal_padded(qwen2vl):
    from rlflow.train.update import policy_token_logprobs
    from tests.train.test_train_packing import assert_close_on_targets, rollout_batch

    _, policy, processor, _ = qwen2vl
    batch = rollout_batch(policy, processor.tokenizer.pad_token_id, mixed_prompts(processor))
    with torch.no_grad():
        padded, padded_entropy = policy_token_logprobs(
            policy, batch, True, packed=False, router_replay=False
        )
        packed, packed_entropy = policy_token_logprobs(
            policy, batch, True, packed=True, router_replay=False
        )
    assert_close_on_targets(packed, padded, batch.target_mask)
    assert_close_on_targets(packed_entropy, padded_entropy, batch.target_mask)


def test_qwen2vl_recipe_trains(tmp_path):
    """A few GRPO steps of recipes/tiny-qwen2vl-clevr-1n1g-cpu.yaml (builtin:tiny-qwen2vl)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlflow.cli",
            "train",
            "recipes/tiny-qwen2vl-clevr-1n1g-cpu.yaml",
            "grpo.max_num_steps=3",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "grpo.val_period=3",
            "grpo.max_val_samples=8",
            "warm_start.num_steps=2",
            "warm_start.batch_size=8",
            "logging.progress_bar=false",
            "--run-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "validation accuracy:" in result.stderr
    config = json.loads((tmp_path / "model" / "tiny-qwen2vl-seed0" / "config.json").read_text())
    assert config["model_type"] == "qwen2_vl"
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in steps) == 3
