"""Sequence packing, token-budget micro-batches and vision-feature reuse change no number.

The padded path (every row padded to the longest, full [B, T, T] attention mask, logits at every
position) is the reference: the packed path must give the same logprobs, entropies, losses and
gradients on the real tiny megatron-core models, in fp32 on CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlflow.generation.base import Completion
from rlflow.model.vision_cache import VisionCache
from rlflow.train.rollouts import build_train_batch
from rlflow.train.update import (
    Batching,
    micro_batches,
    policy_token_logprobs,
    rollout_logprobs,
)
from tests.tiny import FP32, SINGLE, mixed_prompts

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
# Response lengths per rollout: ragged, from one token to a dozen.
RESPONSE_LENGTHS = [5, 1, 12, 3, 7, 9, 2, 6]


@pytest.fixture(scope="module")
def prompts(tiny_processor):
    image, text, video, image2 = mixed_prompts(tiny_processor)
    return {
        "image": [image, image2],
        "video": [video],
        "text": [text],
        "mixed": [image, text, video, image2],
    }


def rollout_batch(policy, pad_token_id, prompts, group=2, seed=0):
    """`group` rollouts per prompt (the same Prompt object, as in GRPO), ragged random answers.

    One answer holds the image pad token: generated text, never a media slot.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = [p for p in prompts for _ in range(group)]
    completions = []
    for i, _ in enumerate(rows):
        n = RESPONSE_LENGTHS[i % len(RESPONSE_LENGTHS)]
        ids = torch.randint(0, 500, (n,), generator=generator).tolist()
        if i == 2 and policy.is_multimodal:
            ids[-1] = policy.media_tokens.image
        completions.append(Completion(ids, [0.0] * n, "length"))
    advantages = torch.randn(len(rows), generator=generator).tolist()
    return build_train_batch(
        rows, completions, advantages, prompt_ids=policy.prompt_ids, pad_token_id=pad_token_id
    )


def assert_close_on_targets(packed, padded, mask, tol=1e-5):
    assert packed.shape == padded.shape
    diff = (packed - padded).abs()[mask]
    assert diff.numel() == int(mask.sum()) > 0
    assert float(diff.max()) <= tol, float(diff.max())
    assert torch.all(packed[~mask] == 0)  # packed computes targets only


@pytest.mark.parametrize("kind", ["image", "video", "text", "mixed"])
def test_packed_logprobs_equal_padded(kind, tiny_policy, tiny_processor, prompts):
    batch = rollout_batch(tiny_policy, tiny_processor.tokenizer.pad_token_id, prompts[kind])
    with torch.no_grad():
        padded, padded_entropy = policy_token_logprobs(
            tiny_policy, batch, True, packed=False, router_replay=False
        )
        packed, packed_entropy = policy_token_logprobs(
            tiny_policy, batch, True, packed=True, router_replay=False
        )
    assert_close_on_targets(packed, padded, batch.target_mask)
    assert_close_on_targets(packed_entropy, padded_entropy, batch.target_mask)


def test_packed_logprobs_equal_padded_text_only_qwen3(single_rank, tmp_path_factory):
    """Plain RoPE (no mrope): positions restart in every packed row."""
    from transformers import AutoTokenizer

    from rlflow.generation.base import Prompt
    from rlflow.model.build import load_policy
    from rlflow.model.media import Media
    from rlflow.model.tiny import write_tiny_text_checkpoint

    path = write_tiny_text_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3", seed=0)
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = []
    for i, question in enumerate(["How many?", "Count the red squares and the blue circles."]):
        ids = tokenizer(question)["input_ids"]
        prompts.append(Prompt(f"t{i}", question, tuple(ids), Media()))
    batch = rollout_batch(policy, tokenizer.pad_token_id, prompts, group=3)
    with torch.no_grad():
        padded, _ = policy_token_logprobs(policy, batch, packed=False, router_replay=False)
        packed, _ = policy_token_logprobs(policy, batch, packed=True, router_replay=False)
    assert_close_on_targets(packed, padded, batch.target_mask)


def test_micro_batches_by_rows_or_token_budget():
    lengths = [10, 30, 5, 50, 20, 20]
    assert micro_batches(lengths, 4, max_tokens=0, packed=True) == [[0, 1, 2, 3], [4, 5]]
    # packed: real tokens; the 50-token row is longer than the budget and goes alone
    assert micro_batches(lengths, 4, max_tokens=40, packed=True) == [[0, 1], [2], [3], [4, 5]]
    # padded: rows x longest row
    assert micro_batches(lengths, 4, max_tokens=60, packed=False) == [[0, 1], [2], [3], [4, 5]]
    assert micro_batches(lengths, 1, max_tokens=1000, packed=True) == [[0, 1, 2, 3, 4, 5]]


def test_budgeted_packed_rollout_logprobs_equal_padded(tiny_policy, tiny_processor, prompts):
    batch = rollout_batch(tiny_policy, tiny_processor.tokenizer.pad_token_id, prompts["mixed"])
    padded, padded_entropy = rollout_logprobs(
        tiny_policy,
        batch,
        Batching(3, max_tokens=0, packed=False),
        with_entropy=True,
        router_replay=False,
    )
    budget = max(batch.lengths) + 10  # several micro-batches of different row counts
    assert 1 < len(micro_batches(batch.lengths, 3, max_tokens=budget, packed=True)) < len(batch)
    packed, packed_entropy = rollout_logprobs(
        tiny_policy,
        batch,
        Batching(3, max_tokens=budget, packed=True),
        with_entropy=True,
        router_replay=False,
    )
    assert_close_on_targets(packed, padded, batch.target_mask)
    assert_close_on_targets(packed_entropy, padded_entropy, batch.target_mask)


@pytest.fixture(scope="module")
def trainable(single_rank, tiny_ckpt):
    from rlflow.model.build import load_policy

    return load_policy(tiny_ckpt, FP32, SINGLE, trainable=True)


def loss_and_grads(policy, batch, cache: VisionCache):
    """GRPO update metrics (loss terms, grad norm) and the gradients it leaves (lr 0)."""
    from rlflow.recipe.load import load_recipe
    from rlflow.train.update import Optimizer, grpo_update

    policy.vision_cache = cache
    batching = Batching(len(batch), max_tokens=0, packed=True)
    old, _ = rollout_logprobs(
        policy, batch, batching, with_entropy=False, router_replay=False
    )  # fills the cache
    recipe = load_recipe(
        RECIPE, ["loss.kl_penalty=0", "optimizer.lr=0", "optimizer.max_grad_norm=0"]
    ).recipe
    optimizer = Optimizer.from_config(policy, recipe.optimizer)
    shifted = old + 0.05 * batch.target_mask  # ratios away from 1: clipping takes part
    metrics = grpo_update(
        policy,
        optimizer,
        batch,
        old_logprobs=shifted,
        ref_logprobs=None,
        loss_cfg=recipe.loss,
        batching=Batching(3, max_tokens=0, packed=True),
        num_minibatches=1,
    ).metrics
    grads = {
        name: p.main_grad.clone()
        for name, p in policy.core.named_parameters()
        if p.requires_grad and p.main_grad is not None
    }
    return metrics, grads


def test_vision_feature_reuse_gives_the_same_loss_and_gradients(trainable, tiny_processor, prompts):
    batch = rollout_batch(trainable, tiny_processor.tokenizer.pad_token_id, prompts["mixed"])
    fresh_metrics, fresh_grads = loss_and_grads(trainable, batch, VisionCache(enabled=False))
    cache = VisionCache(enabled=True)
    metrics, grads = loss_and_grads(trainable, batch, cache)
    # three prompts with media, each run through the tower once for both passes
    assert cache.computed == 3
    assert metrics.keys() == fresh_metrics.keys()
    for key, value in metrics.items():
        assert value == pytest.approx(fresh_metrics[key], rel=1e-6, abs=1e-7), key
    assert grads.keys() == fresh_grads.keys() and any(g.abs().sum() > 0 for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, fresh_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_negative_token_budget_is_refused():
    from rlflow.errors import RlflowError
    from rlflow.rules import load_checked

    with pytest.raises(RlflowError) as caught:
        load_checked(RECIPE, ["optimizer.max_tokens_per_micro_batch=-1"])
    text = "\n".join(d.render() for d in caught.value.diagnostics)
    assert "`optimizer.max_tokens_per_micro_batch` must not be negative" in text


def test_grpo_run_with_packing_and_a_token_budget_matches_the_padded_run(tmp_path):
    """Two short `rlflow train` runs (warm start, GRPO steps with KL, validation): same metrics.

    The reference run has neither packing nor shared prompts in generation; the other has both.
    Both train on mixed image, video and text batches and validate on all three kinds (the
    first 12 validation rows hold each kind): the suite's end-to-end run of mixed batches."""
    from rlflow.train.metrics import read_metrics
    from tests.train.test_train_runs import comparable, train

    short = ["grpo.max_num_steps=2", "warm_start.num_steps=2", "checkpointing.enabled=false"]
    short += ["grpo.val_at_start=false", "grpo.max_val_samples=12"]
    short += ["data.train.kind=mixed", "data.validation.kind=mixed"]
    short += ["data.video.num_frames=4", "data.video.temporal_patch_size=2", "data.video.fps=2.0"]
    runs = {}
    for name, overrides in {
        "padded": ["optimizer.sequence_packing=false", "generation.share_prompts=false"],
        "packed": ["optimizer.sequence_packing=true", "optimizer.max_tokens_per_micro_batch=200"],
    }.items():
        result = train(tmp_path / name, *short, *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = comparable(read_metrics(tmp_path / name))
    padded, packed = runs["padded"], runs["packed"]
    assert [r["step"] for r in packed] == [1, 2]
    assert {"val/accuracy_image", "val/accuracy_video", "val/accuracy_text"} <= set(packed[-1])
    assert packed[1]["train/real_tokens"] > 0
    for want, got in zip(padded, packed, strict=True):
        assert want.keys() == got.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (want["step"], key)


def _tensor_parallel_worker(rank: int, port: int, out: str) -> None:
    """One of two tensor-parallel ranks: packed vs padded logprobs and entropies (vocab-sharded
    logits: megatron's vocab-parallel cross entropy and the gathered entropy)."""
    import json
    import os

    from transformers import AutoProcessor

    from rlflow import parallel
    from rlflow.compat import library_logs
    from rlflow.model.build import load_policy
    from rlflow.recipe.schema import ParallelismConfig
    from tests.tiny import base_recipe, tiny_checkpoint

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    library_logs.quiet()
    layout = ParallelismConfig(2, 1, 1, 1, "off")
    parallel.init_parallel(
        layout, seed=1, timeout_s=base_recipe().watchdog.collective_timeout_s, placement=None
    )
    checkpoint = tiny_checkpoint(os.path.join(out, "model"))
    policy = load_policy(checkpoint, FP32, layout, trainable=False)
    processor = AutoProcessor.from_pretrained(str(checkpoint))
    batch = rollout_batch(policy, processor.tokenizer.pad_token_id, mixed_prompts(processor))
    with torch.no_grad():
        padded, padded_entropy = policy_token_logprobs(
            policy, batch, True, packed=False, router_replay=False
        )
        packed, packed_entropy = policy_token_logprobs(
            policy, batch, True, packed=True, router_replay=False
        )
    mask = batch.target_mask
    if rank == 0:
        result = {
            "logprobs": float((packed - padded).abs()[mask].max()),
            "entropy": float((packed_entropy - padded_entropy).abs()[mask].max()),
            "vocab_shard": policy.core.language_model.output_layer.output_size_per_partition,
        }
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)


def test_packed_logprobs_equal_padded_under_tensor_parallelism(tmp_path):
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tensor_parallel_worker, args=(port, str(tmp_path)), nprocs=2)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["vocab_shard"] < 512  # the vocabulary really is split over the two ranks
    assert result["logprobs"] <= 1e-5 and result["entropy"] <= 1e-5, result


def test_one_minibatch_update_gives_the_old_logprobs_itself(trainable, tiny_processor, prompts):
    """With one mini-batch the loop skips the separate old-logprob pass: the update's forward
    gives them. Loss terms (KL and TIS weights included), gradients, the returned logprobs and
    entropy equal those of the update run after a recomputation pass."""
    from rlflow.recipe.load import load_recipe
    from tests.tiny import recipe_update

    overrides = ["loss.kl_penalty=0.1", "loss.importance_sampling.mode=tis", "optimizer.lr=0"]
    recipe = load_recipe(RECIPE, [*overrides, "optimizer.max_grad_norm=0"]).recipe
    batch = rollout_batch(trainable, tiny_processor.tokenizer.pad_token_id, prompts["mixed"])
    batching = Batching(3, max_tokens=0, packed=True)
    old, entropy = rollout_logprobs(
        trainable, batch, batching, with_entropy=True, router_replay=False
    )
    ref = old - 0.1 * batch.target_mask  # a reference that disagrees: the KL term is not 0

    def update(old_logprobs, minibatches=1):
        result = recipe_update(
            trainable, batch, recipe, old_logprobs=old_logprobs, ref_logprobs=ref,
            batching=batching, minibatches=minibatches,
        )  # fmt: skip
        grads = {
            name: p.main_grad.clone()
            for name, p in trainable.core.named_parameters()
            if p.requires_grad and p.main_grad is not None
        }
        return result, grads

    recomputed, recomputed_grads = update(old)
    itself, grads = update(None)
    assert recomputed.old_logprobs is None and recomputed.entropy is None
    assert itself.metrics.keys() == recomputed.metrics.keys()
    for key, value in itself.metrics.items():
        assert value == pytest.approx(recomputed.metrics[key], rel=1e-5, abs=1e-6), key
    assert recomputed.metrics["kl"] > 0
    assert grads.keys() == recomputed_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, recomputed_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())
    torch.testing.assert_close(itself.old_logprobs, old, rtol=0, atol=1e-5)
    torch.testing.assert_close(itself.entropy, entropy, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="2 mini-batches"):
        update(None, minibatches=2)
