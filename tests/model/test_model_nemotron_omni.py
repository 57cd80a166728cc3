"""Nemotron Omni (RADIO + mlp1 + Nemotron-H) through the family seam: the checkpoint in the layout
megatron-bridge's Omni bridge reads, loaded into rlflow's Megatron model (transformers' RADIO
tower, megatron-core's hybrid language model on rlflow's PyTorch Mamba kernels), equal to the HF
side (rlflow/model/families/nemotron_omni/hf.py) in fp32 on a right-padded image/text/video
batch: logits, and token logprobs through the packed trainer path; the export round trip."""

from __future__ import annotations

import pytest
import torch

from rlflow.model.forward import policy_logits
from rlflow.model.media import Media
from tests.tiny import FP32, SINGLE, mixed_prompts, right_padded


@pytest.fixture(scope="module")
def omni(single_rank, family_ckpt):
    from rlflow.generation.hf import load_hf_model
    from rlflow.model.build import load_policy
    from rlflow.model.processor import CheckpointProcessor

    path = family_ckpt("tiny-nemotron-omni")
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    processor = CheckpointProcessor(path)
    hf = load_hf_model(path, torch.float32, "cpu")
    return policy, processor, hf, mixed_prompts(processor.processor)


def test_logits_and_packed_logprobs_match_hf(omni):
    from rlflow.model.packed_forward import pack_rows, target_logprobs

    policy, processor, hf, prompts = omni
    ids, mask = right_padded([p.token_ids for p in prompts], processor.pad_token_id)
    media = Media.concat([p.media for p in prompts])
    kinds = [type(layer).__name__ for layer in policy.core.language_model.decoder.layers]
    assert kinds == ["MambaLayer", "MLPLayer", "TransformerLayer", "MambaLayer", "MLPLayer"]
    with torch.no_grad():
        ours = policy_logits(policy.core, ids, mask, media)
        ref = hf(
            input_ids=ids,
            attention_mask=mask.long(),
            **{k: v for k, v in vars(media).items() if v is not None},
        ).logits
        targets = mask[:, 1:] & mask[:, :-1]
        packed = pack_rows(policy.core, ids, mask, mask, targets, [p.media for p in prompts])
        features = policy.family.vision_features(policy.core, media)
        packed_lp, _ = target_logprobs(policy.core, packed, features, with_entropy=False)
    assert (ours[mask] - ref[mask]).abs().max() < 1e-4
    ref_lp = torch.log_softmax(ref[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0][targets]
    # the trainer's token_mult_prob_error: exp of the mean |logprob difference|
    assert float(torch.exp((packed_lp - ref_lp).abs().mean())) < 1.0 + 1e-5
    assert (packed_lp - ref_lp).abs().max() < 1e-4


def test_export_round_trips_into_the_hf_model(omni):
    from safetensors import safe_open

    from rlflow.generation.hf import copy_policy_into

    policy, _, hf, _ = omni
    with safe_open(str(policy.checkpoint / "model.safetensors"), "pt") as saved:
        tops = {name.split(".")[0] + "." + name.split(".")[1] for name in saved.keys()}
    # the layout megatron-bridge's Omni bridge reads (transformers renames it in memory)
    assert tops == {"vision_model.radio_model", "mlp1.0", "mlp1.1", "mlp1.3"} | {
        "language_model.backbone",
        "language_model.lm_head",
    }
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    copy_policy_into(hf, policy)  # every name lines up, or it raises
    after = hf.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
