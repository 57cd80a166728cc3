"""Tensor and sequence parallelism change no number of the trainer (two gloo ranks, fp32, CPU).

The same tiny Qwen2.5-VL policy, on the same mixed batch (image, video and text rollouts),
runs three ways on two ranks: TP=1 (each rank the whole model), TP=2 without and TP=2 with
sequence parallelism. Qwen3-VL (whose DeepStack adds vision features inside the first layers,
split like the hidden states under sequence parallelism) runs TP=2 without and with it. Logprobs, entropies and the gradients of a logprob loss must agree, on
the packed and on the padded path. Under TP the vocabulary is split: logprobs and entropies come
from vocab-parallel reductions (rlflow/model/logits.py), never from gathered logits.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from tests.tiny import FP32

LAYOUTS = {"tp1": (1, "off"), "tp2": (2, "off"), "tp2_sp": (2, "on")}
FAMILIES = {"tiny-qwen25vl": ("tp1", "tp2", "tp2_sp"), "tiny-qwen3vl": ("tp2", "tp2_sp")}


def _results(policy, batch, packed: bool) -> dict[str, torch.Tensor]:
    """Logprobs, entropies (no grad) and the gradients of sum(w * logprobs) after DDP/TP
    reduction, by parameter name (vocab-split parameters gathered, others as they are)."""
    from megatron.core.distributed import finalize_model_grads

    from rlflow.train.update import policy_token_logprobs

    mask = batch.target_mask
    with torch.no_grad():
        _, entropy = policy_token_logprobs(policy, batch, True, packed=packed, router_replay=False)
    for chunk in policy.chunks:
        chunk.zero_grad_buffer()
    logprobs, _ = policy_token_logprobs(policy, batch, packed=packed, router_replay=False)
    weights = torch.linspace(-1.0, 1.0, int(mask.sum()))
    (logprobs[mask] * weights).sum().backward()
    finalize_model_grads(policy.chunks)
    out = {"logprobs": logprobs.detach()[mask], "entropy": entropy[mask]}
    for name, param in policy.core.named_parameters():
        if param.requires_grad and ("layernorm" in name or "word_embeddings" in name):
            out[f"grad/{name}"] = _whole(name, param.main_grad.detach().clone())
    return out


def _whole(name: str, grad: torch.Tensor) -> torch.Tensor:
    """A vocabulary-split gradient gathered over the TP ranks; other gradients unchanged."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if "word_embeddings" not in name or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return grad
    return gather_from_tensor_model_parallel_region(grad.t().contiguous()).t()


def _worker(rank: int, port: int, out: str, name: str, checkpoint: str) -> None:
    from megatron.core import parallel_state
    from transformers import AutoProcessor

    from rlflow import parallel
    from rlflow.compat import library_logs
    from rlflow.model.build import load_policy
    from rlflow.recipe.schema import ParallelismConfig
    from tests.tiny import base_recipe, mixed_prompts
    from tests.train.test_train_packing import rollout_batch

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    library_logs.quiet()
    timeout_s = base_recipe().watchdog.collective_timeout_s
    results, shards = {}, {}
    for layout_name in FAMILIES[name]:
        tp, sp = LAYOUTS[layout_name]
        layout = ParallelismConfig(tp, 1, 1, 1, sp)
        parallel.init_parallel(layout, seed=1, timeout_s=timeout_s, placement=None)
        policy = load_policy(Path(checkpoint), FP32, layout, trainable=True)
        processor = AutoProcessor.from_pretrained(checkpoint)
        batch = rollout_batch(policy, processor.tokenizer.pad_token_id, mixed_prompts(processor))
        for packed in (True, False):
            path = "packed" if packed else "padded"
            results[f"{layout_name}/{path}"] = _results(policy, batch, packed)
        lm = policy.core.language_model
        shards[layout_name] = lm.output_layer.output_size_per_partition
        shards[f"{layout_name}/sequence_parallel"] = bool(lm.config.sequence_parallel)
        del policy
        parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(results, os.path.join(out, "results.pt"))
        with open(os.path.join(out, "layouts.json"), "w") as f:
            json.dump(shards, f)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tensor_and_sequence_parallel_logprobs_and_grads_equal_one_rank(
    tmp_path, family_ckpt, name
):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    checkpoint = str(family_ckpt(name))
    mp.spawn(_worker, args=(port, str(tmp_path), name, checkpoint), nprocs=2)
    layouts = json.loads((tmp_path / "layouts.json").read_text())
    assert layouts["tp2_sp/sequence_parallel"] and not layouts["tp2/sequence_parallel"]
    if "tp1" in layouts:
        assert layouts["tp2"] * 2 == layouts["tp1"]  # the vocabulary really is split
    reference, *others = FAMILIES[name]
    results = torch.load(tmp_path / "results.pt")
    for path in ("packed", "padded"):
        want = results[f"{reference}/{path}"]
        assert any(k.startswith("grad/") for k in want)
        for other in others:
            got = results[f"{other}/{path}"]
            assert got.keys() == want.keys()
            for key, value in want.items():
                gap = float((got[key] - value).abs().max())
                scale = float(value.abs().max()) or 1.0
                assert gap <= 1e-5 * max(1.0, scale), (name, other, path, key, gap)
