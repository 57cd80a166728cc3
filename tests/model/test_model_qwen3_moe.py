"""Text-only Qwen3-MoE (8 experts, top-2) takes the same path as the dense families: bridge ->
Megatron with rlflow's grouped experts, parity with HF transformers in fp32 through the padded
and the packed forward, greedy tokens, and an exact HF round trip."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import (
    full_forward_greedy_equals_hf,
    logprobs_against_hf,
    policy_and_hf,
    right_padded,
)


@pytest.fixture(scope="module")
def moe_model(single_rank, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from rlflow.model.families.qwen3_moe import write_tiny_qwen3_moe

    path = write_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe"), seed=0, lm_head_scale=8.0)
    return policy_and_hf(path, AutoModelForCausalLM)


def test_the_experts_are_grouped_and_share_one_weight_block(moe_model):
    policy = moe_model[0]
    experts = policy.core.decoder.layers[0].mlp.experts
    assert type(experts).__name__ == "GroupedExperts" and experts.num_local_experts == 8
    fc1, fc2 = experts.stacked_weights()
    first = experts.local_experts[0].linear_fc1.weight
    assert fc1.shape == (8, 2 * 64, 128) and fc2.shape == (8, 128, 64)
    assert fc1.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()  # a view


def test_padded_and_packed_logprobs_match_hf(moe_model):
    policy, tokenizer, hf, rows = moe_model
    ids, mask = right_padded(rows, tokenizer.pad_token_id)
    packed_lp, ref_lp, _ = logprobs_against_hf(policy, hf, ids, mask)
    assert (packed_lp - ref_lp).abs().max() < 1e-4


def test_greedy_tokens_match_hf(moe_model):
    policy, tokenizer, hf, rows = moe_model
    for row in rows:
        full_forward_greedy_equals_hf(policy, hf, row, 10, tokenizer.pad_token_id)


def test_hf_round_trip_is_exact(moe_model):
    from safetensors.torch import load_file

    from rlflow.model.build import export_hf_state_dict

    policy, _, hf, _ = moe_model
    exported = export_hf_state_dict(policy)
    on_disk = load_file(str(policy.checkpoint / "model.safetensors"))
    assert sorted(exported) == sorted(on_disk)
    assert all(torch.equal(exported[k], on_disk[k]) for k in on_disk)
    # ... and in HF's in-memory (fused experts) layout, as the HF backend loads it
    fused = policy.family.hf_state_dict(exported)
    state = hf.state_dict()
    assert sorted(fused) == sorted(state)
    assert all(torch.equal(fused[k], state[k]) for k in state)


def test_moe_recipe_trains_with_router_replay(tmp_path):
    """The CPU recipe through the console script: GRPO steps with router replay, and the MoE
    metrics in the run's metrics file (routing agreement, load spread, load-balancing loss), and
    the HF export of its last step (`checkpointing.hf_export_period`), which transformers loads
    and generates from."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from rlflow.train.metrics import read_metrics

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    result = subprocess.run(
        [
            sys.executable, "-m", "rlflow.cli", "train",
            "recipes/tiny-qwen3-moe-text-1n1g-cpu.yaml",
            "grpo.max_num_steps=2", "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4", "warm_start.num_steps=1",
            "grpo.max_val_samples=4", "logging.progress_bar=false",
            "checkpointing.hf_export_period=2", "--run-dir", str(tmp_path),
        ],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], env=env,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in read_metrics(tmp_path) if "train/reward" in r]
    assert len(steps) == 2
    for row in steps:
        assert row["moe/routing_agreement"] > 0.99  # fp32: generation routes as the trainer
        assert 1.0 <= row["moe/load_spread"] and "moe/load_spread_layer1" in row
        assert row["moe/aux_loss"] > 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = tmp_path / "hf" / "step_000002"
    model, info = AutoModelForCausalLM.from_pretrained(str(exported), output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and not any(info.values()), info
    ids = AutoTokenizer.from_pretrained(str(exported))("How many?", return_tensors="pt").input_ids
    new = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert new.shape[1] == ids.shape[1] + 3
