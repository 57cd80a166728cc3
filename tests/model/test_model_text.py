"""Text-only Qwen2 / Qwen3 checkpoints take the same path as Qwen2.5-VL: bridge -> Megatron,
forward parity with HF, generation parity, and a short GRPO run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlflow.generation.base import Prompt, SamplingParams
from rlflow.model.forward import policy_logits
from rlflow.model.media import Media
from tests.tiny import FP32, SINGLE, megatron_generation

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [
    "How many red squares are there?",
    "Count.",
    "A picture shows a large blue triangle and a small red circle. How many circles?",
]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def text_model(request, single_rank, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.model.build import load_policy
    from rlflow.model.tiny import write_tiny_text_checkpoint

    path = write_tiny_text_checkpoint(
        tmp_path_factory.mktemp(request.param), family=request.param, seed=0, lm_head_scale=8.0
    )
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rows = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for q in QUESTIONS
    ]
    return policy, tokenizer, hf, rows


def test_megatron_logits_match_hf(text_model):
    policy, tokenizer, hf, rows = text_model
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, row in enumerate(rows):  # right padding, as the trainer's batches are
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    with torch.no_grad():
        ours = policy_logits(policy.core, ids, mask, Media())
        ref = hf(input_ids=ids, attention_mask=mask.long()).logits
    assert (ours[mask] - ref[mask]).abs().max() < 1e-4


def test_generation_matches_the_hf_reference(text_model):
    from rlflow.generation.hf import HFGeneration

    policy, tokenizer, _, rows = text_model
    prompts = [Prompt(str(i), "", tuple(r), Media()) for i, r in enumerate(rows)]
    params = SamplingParams(12, 0.0, 1.0, 0, 0, (tokenizer.eos_token_id,), True)
    ours = megatron_generation(policy, tokenizer.pad_token_id, max_batch_size=8)
    ours = ours.generate(prompts, params)
    ref = HFGeneration(policy, tokenizer.pad_token_id, 8).generate(prompts, params)
    for a, b in zip(ours, ref):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_text_recipe_trains(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlflow.cli",
            "train",
            "recipes/tiny-qwen3-text-1n1g-cpu.yaml",
            "grpo.max_num_steps=2",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "warm_start.num_steps=2",
            "grpo.max_val_samples=8",
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
