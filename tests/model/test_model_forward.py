"""The Megatron policy (built through megatron-bridge) computes what HF computes."""

from __future__ import annotations

import pytest
import torch

from rlflow.model.forward import policy_logits
from tests.tiny import hf_logits_gap, make_prompt


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(tiny_ckpt), dtype=torch.float32
    ).eval()


def test_logits_match_hf_for_a_left_padded_mixed_batch(tiny_policy, tiny_processor, hf_model):
    prompts = [
        make_prompt(tiny_processor, "image", "How many red squares?"),
        make_prompt(tiny_processor, "text", "How many?"),
        make_prompt(tiny_processor, "video", "How many objects appear?", seed=3),
    ]
    pad = tiny_processor.tokenizer.pad_token_id
    assert hf_logits_gap(hf_model, tiny_policy, prompts, pad) < 1e-4


def test_export_round_trip_is_exact(tiny_policy, tiny_ckpt):
    from safetensors import safe_open

    from rlflow.model.build import export_hf_state_dict

    exported = export_hf_state_dict(tiny_policy)
    with safe_open(str(tiny_ckpt / "model.safetensors"), "pt") as disk:
        assert set(exported) == set(disk.keys())
        for name in disk.keys():
            assert torch.equal(exported[name], disk.get_tensor(name)), name


def test_generated_pad_tokens_are_text_not_media_slots(tiny_policy, tiny_processor):
    """A media pad token the policy generated must not be treated as an image slot."""
    prompt = make_prompt(tiny_processor, "image", "How many?")
    image_pad = tiny_policy.media_tokens.image
    ids = torch.tensor([list(prompt.token_ids) + [image_pad, image_pad]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    prompt_mask = mask.clone()
    prompt_mask[0, len(prompt.token_ids) :] = False
    with torch.no_grad():
        logits = policy_logits(tiny_policy.core, ids, mask, prompt.media, prompt_mask)
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="pad tokens"):
        policy_logits(
            tiny_policy.core, ids, mask, prompt.media
        )  # without the prompt mask: 2 extra slots
