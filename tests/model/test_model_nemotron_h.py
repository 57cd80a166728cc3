"""Nemotron-H (Mamba-2 + attention + MLP) through the family seam: megatron-bridge's mappings into
megatron-core's hybrid model with local layers and rlflow's PyTorch Mamba kernels (CPU), equal
to HF transformers in fp32: logits and token logprobs through the padded and the packed forward
(packed rows keep their own conv and scan state), greedy tokens, and an exact HF round trip."""

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
def hybrid(single_rank, family_ckpt):
    from transformers import NemotronHForCausalLM

    return policy_and_hf(family_ckpt("tiny-nemotron-h"), NemotronHForCausalLM)


def test_the_model_is_megatron_cores_hybrid_on_the_reference_kernels(hybrid):
    from megatron.core.ssm import mamba_mixer

    policy = hybrid[0]
    kinds = [type(layer).__name__ for layer in policy.core.decoder.layers]
    assert kinds == ["MambaLayer", "MLPLayer", "TransformerLayer", "MambaLayer", "MLPLayer"]
    assert (
        mamba_mixer.mamba_split_conv1d_scan_combined.__module__ == "rlflow.compat.mamba_reference"
    )


def test_padded_and_packed_logprobs_match_hf(hybrid):
    policy, tokenizer, hf, rows = hybrid
    ids, mask = right_padded(rows, tokenizer.pad_token_id)
    packed_lp, ref_lp, padded_lp = logprobs_against_hf(policy, hf, ids, mask)
    # the trainer's token_mult_prob_error: exp of the mean |logprob difference|
    assert float(torch.exp((packed_lp - ref_lp).abs().mean())) < 1.0 + 1e-5
    assert (packed_lp - ref_lp).abs().max() < 1e-4
    assert (packed_lp - padded_lp).abs().max() < 1e-5


def test_greedy_tokens_match_hf(hybrid):
    policy, tokenizer, hf, rows = hybrid
    full_forward_greedy_equals_hf(policy, hf, rows[0], 6, tokenizer.pad_token_id)


def test_hf_round_trip_is_exact(hybrid):
    from safetensors.torch import load_file

    from rlflow.model.build import export_hf_state_dict

    policy = hybrid[0]
    exported = export_hf_state_dict(policy)
    on_disk = load_file(str(policy.checkpoint / "model.safetensors"))
    assert sorted(exported) == sorted(on_disk)
    assert all(torch.equal(exported[k], on_disk[k]) for k in on_disk)
    # ... and under HF's in-memory names (`model.*`, on disk `backbone.*`), as the HF backend loads
    state = hybrid[2].state_dict()
    in_memory = policy.family.hf_state_dict(exported)
    assert sorted(in_memory) == sorted(state)
    assert all(torch.equal(in_memory[k], state[k]) for k in state)


def test_engine_state_slots_continue_the_policys_own_mixer(hybrid):
    """rlflow/generation/megatron/mamba_state.py on the policy's megatron-core mixer (views of
    its weights): a prefill then decode steps equal the mixer's full-sequence forward."""
    from rlflow.generation.megatron.mamba_state import MambaStates, MambaWeights, decode, prefill

    mixer = hybrid[0].core.decoder.layers[0].mixer
    weights = MambaWeights.of(mixer)
    assert weights.in_proj.data_ptr() == mixer.in_proj.weight.data_ptr()  # a view
    hidden = torch.randn(12, 1, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = mixer(hidden)[0][:, 0]
        states = MambaStates([weights], slots=1, device="cpu", dtype=torch.float32)
        slot = states.allocate()
        got = [prefill(weights, hidden[:9, 0], [9], states, 0, [slot])]
        for t in range(9, 12):
            got.append(decode(weights, hidden[t], states, 0, torch.tensor([slot])))
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-5)
