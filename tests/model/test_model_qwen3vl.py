"""Qwen3-VL, dense and MoE, through rlflow/model/family.py: HF's tower with DeepStack +
megatron-core's GPT (local spec; MoE: megatron-core's MoE layer), interleaved mrope. Against HF
in fp32 on CPU: logits for image, video, text and mixed batches, the trainer's packed logprobs,
greedy tokens and logprobs, the export round trip, and a few GRPO steps of each CPU recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlflow.generation.base import Completion
from rlflow.model.media import Media
from tests.tiny import FP32, SINGLE, greedy, hf_logits_gap, megatron_generation, mixed_prompts

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["tiny-qwen3vl", "tiny-qwen3vl-moe"]


@pytest.fixture(scope="module", params=NAMES)
def qwen3vl(request, single_rank, family_ckpt):
    """(checkpoint, policy, processor, HF model) of one Qwen3-VL family."""
    from transformers import AutoProcessor

    from rlflow.model import family
    from rlflow.model.build import load_policy

    path = family_ckpt(request.param)
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    processor = AutoProcessor.from_pretrained(str(path))
    hf_class = family.by_builtin(request.param).hf_class()
    hf = hf_class.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, policy, processor, hf


@pytest.fixture(scope="module")
def batches(qwen3vl):
    image, text, video, image2 = mixed_prompts(qwen3vl[2])
    return {
        "image": [image, image2],
        "video": [video],
        "text": [text],
        "mixed": [image, text, video, image2],
    }


def test_the_family_is_found_and_builds_its_pieces(qwen3vl):
    from rlflow.model import family
    from rlflow.model.families.qwen3vl.model import InterleavedMRoPE

    path, policy, _, _ = qwen3vl
    assert family.of_checkpoint(path) is policy.family
    assert type(policy.core.visual).__name__ == "Qwen3VLVisionModel"
    assert isinstance(policy.core.language_model.rotary_pos_emb, InterleavedMRoPE)
    mlp = type(policy.core.language_model.decoder.layers[0].mlp).__name__
    assert mlp == ("MoELayer" if policy.family.architectures[0].startswith("Qwen3VLMoe") else "MLP")


@pytest.mark.parametrize("kind", ["image", "video", "text", "mixed"])
def test_logits_match_hf(qwen3vl, batches, kind):
    _, policy, processor, hf = qwen3vl
    assert hf_logits_gap(hf, policy, batches[kind], processor.tokenizer.pad_token_id) < 1e-4


def test_without_deepstack_or_with_sectioned_mrope_the_logits_differ(qwen3vl, batches, monkeypatch):
    """The parity above holds because both pieces are there: each one missing breaks it."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
    )

    from rlflow.model.families.qwen3vl import deepstack

    _, policy, processor, hf = qwen3vl
    pad = processor.tokenizer.pad_token_id
    with monkeypatch.context() as patch:
        patch.setattr(deepstack.DeepStack, "add", lambda self, hidden, layer: hidden)
        assert hf_logits_gap(hf, policy, batches["image"], pad) > 1e-3
    with monkeypatch.context() as patch:
        patch.setattr(type(policy.core.language_model.rotary_pos_emb), "forward",
                      MultimodalRotaryEmbedding.forward)  # fmt: skip
        assert hf_logits_gap(hf, policy, batches["image"], pad) > 1e-3


def test_export_round_trip_is_exact(qwen3vl):
    from safetensors import safe_open

    from rlflow.model.build import export_hf_state_dict

    path, policy, _, _ = qwen3vl
    exported = export_hf_state_dict(policy)
    files = sorted(path.glob("*.safetensors"))
    on_disk = {}
    for file in files:
        with safe_open(str(file), "pt") as disk:
            on_disk |= {name: disk.get_tensor(name) for name in disk.keys()}
    assert set(exported) == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(exported[name], tensor), name


def test_packed_logprobs_match_hf(qwen3vl, batches):
    """The trainer's packed forward (DeepStack at the packed media slots, positions per row)
    gives HF's logprobs of every generated token, right-padded rows of all media kinds."""
    from rlflow.train.rollouts import build_train_batch
    from rlflow.train.update import policy_token_logprobs

    _, policy, processor, hf = qwen3vl
    prompts = [p for p in batches["mixed"] for _ in range(2)]
    generator = torch.Generator().manual_seed(0)
    completions = [
        Completion(torch.randint(20, 500, (n,), generator=generator).tolist(), [0.0] * n, "length")
        for n in (5, 1, 12, 3, 7, 9, 2, 6)
    ]
    batch = build_train_batch(
        prompts,
        completions,
        [0.0] * len(prompts),
        prompt_ids=policy.prompt_ids,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    media = Media.concat(batch.media)
    with torch.no_grad():
        packed, _ = policy_token_logprobs(policy, batch, False, packed=True, router_replay=False)
        logits = hf(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask.long(),
            **policy.family.hf_generate_inputs(batch.input_ids, policy.media_tokens),
            **{k: v for k, v in vars(media).items() if v is not None},
        ).logits
    ref = torch.log_softmax(logits[:, :-1].float(), -1)
    ref = ref.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.target_mask
    assert float((packed - ref).abs()[mask].max()) < 1e-4


def test_greedy_tokens_and_logprobs_match_hf(qwen3vl, batches):
    """HF's generate against the policy's own forward, one token at a time (no KV cache): the
    same greedy tokens, logprobs within 1e-4, for every media kind in one batch."""
    from rlflow.generation.hf import HFGeneration
    from rlflow.model.forward import policy_logits

    _, policy, processor, _ = qwen3vl
    pad, eos = processor.tokenizer.pad_token_id, processor.tokenizer.eos_token_id
    prompts = batches["mixed"]
    ref = HFGeneration(policy, pad, 8).generate(prompts, greedy(8, eos))
    for prompt, expected in zip(prompts, ref):
        ids = torch.tensor([policy.prompt_ids(prompt)])
        prompt_mask = torch.ones_like(ids, dtype=torch.bool)
        logprobs = []
        for _ in range(8):
            mask = torch.ones_like(ids, dtype=torch.bool)
            with torch.no_grad():
                logits = policy_logits(policy.core, ids, mask, prompt.media, prompt_mask)[0, -1]
            step = torch.log_softmax(logits.float(), -1)
            token = int(step.argmax())
            logprobs.append(float(step[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
            prompt_mask = torch.cat([prompt_mask, torch.tensor([[False]])], 1)
        assert ids[0, -8:].tolist() == expected.token_ids, prompt.sample_id
        assert max(abs(a - b) for a, b in zip(logprobs, expected.logprobs)) < 1e-4


@pytest.mark.parametrize("shared", [False, True], ids=["one-row-per-prompt", "shared-prompts"])
@pytest.mark.parametrize("name", NAMES)
def test_megatron_generation_matches_the_hf_backend(single_rank, family_ckpt, shared, name):
    """rlflow's engine on Qwen3-VL, dense and MoE (routed experts in prefill and decode):
    DeepStack in the packed prefill, interleaved mrope positions, text decode; tokens identical
    and logprobs within 1e-4 of HF's generate."""
    from transformers import AutoProcessor

    from rlflow.generation.hf import HFGeneration
    from rlflow.model.build import load_policy
    from rlflow.model.vision_cache import VisionCache

    path = family_ckpt(name)
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    processor = AutoProcessor.from_pretrained(str(path))
    unique = mixed_prompts(processor)
    prompts = [p for p in unique for _ in range(2)] if shared else unique
    pad, eos = processor.tokenizer.pad_token_id, processor.tokenizer.eos_token_id
    policy.vision_cache = VisionCache(enabled=shared)
    ours = megatron_generation(policy, pad, max_batch_size=8, share_prompts=shared)
    ours = ours.generate(prompts, greedy(16, eos))
    ref = HFGeneration(policy, pad, 8).generate(prompts, greedy(16, eos))
    for prompt, a, b in zip(prompts, ours, ref):
        assert a.token_ids == b.token_ids, prompt.sample_id
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4, prompt.sample_id


@pytest.mark.parametrize(
    "recipe", ["tiny-qwen3vl-clevr-1n1g-cpu.yaml", "tiny-qwen3vl-moe-clevr-1n1g-cpu.yaml"]
)
def test_recipe_trains(tmp_path, recipe):
    """Two GRPO steps of each CPU recipe (builtin:tiny-qwen3vl, builtin:tiny-qwen3vl-moe), with
    an HF export at the end that transformers loads."""
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
            f"recipes/{recipe}",
            "grpo.max_num_steps=2",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "grpo.val_period=2",
            "grpo.max_val_samples=4",
            "warm_start.num_steps=1",
            "warm_start.batch_size=4",
            "logging.progress_bar=false",
            "checkpointing.hf_export_period=2",
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
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in steps) == 2
    from transformers import AutoModelForImageTextToText

    exported = tmp_path / "hf" / "step_000002"
    model = AutoModelForImageTextToText.from_pretrained(str(exported))
    assert type(model).__name__.startswith("Qwen3VL")


def test_the_4b_preset_has_qwen3vl_4bs_parameter_count():
    """`init-tiny-model --preset qwen3vl-4b`'s config, on the meta device: Qwen3-VL-4B-Instruct's
    published 4,437,815,808 parameters (415,347,712 in the vision tower), tied head."""
    from rlflow.model.families.qwen3vl import QWEN3VL_PRESETS, _hf_classes, qwen3vl_config
    from rlflow.model.tiny import SPECIAL_TOKENS

    ids = {token: 151643 + i for i, token in enumerate(SPECIAL_TOKENS)}
    config = qwen3vl_config(QWEN3VL_PRESETS["qwen3vl-4b"], ids, 512)
    with torch.device("meta"):
        model = _hf_classes(False)[1]._from_config(config)
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == 4_437_815_808
    assert sum(p.numel() for n, p in params.items() if ".visual." in n) == 415_347_712
    assert config.text_config.rope_parameters["mrope_section"] == [24, 20, 20]
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight


def test_logits_match_hf_at_qwen3vl_4bs_proportions(tmp_path, single_rank):
    """The real 4B's proportions the tiny default lacks: query width (heads x head_dim) wider
    than the hidden size, 4 query heads per KV head, a tied head, three DeepStack layers."""
    from transformers import AutoProcessor

    from rlflow.model.build import load_policy
    from rlflow.model.families.qwen3vl import Qwen3VLSizes, write_tiny_qwen3vl

    sizes = Qwen3VLSizes(hidden=96, intermediate=160, layers=4, heads=4, kv_heads=1, head_dim=64,
                         tie_embeddings=True, mrope_section=(12, 10, 10), vision_depth=4,
                         deepstack_visual_indexes=(0, 1, 2))  # fmt: skip
    path = write_tiny_qwen3vl(tmp_path / "q3", seed=0, sizes=sizes)
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    processor = AutoProcessor.from_pretrained(str(path))
    hf = policy.family.hf_class().from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = mixed_prompts(processor)
    assert hf_logits_gap(hf, policy, prompts, processor.tokenizer.pad_token_id) < 1e-4
