"""The engine's hybrid decoder under tensor parallelism, on two gloo ranks (tiny Nemotron-H:
Mamba-2 + attention + MLP, fp32, CPU): the same greedy tokens and logprobs as one rank, and the
trainer's packed logprobs of those rows equal too.

Two checkpoints: the tiny `M-*M-` (4 query heads over 2 KV heads: TP 2 splits whole KV heads;
the Mamba mixer's 8 heads and 2 B/C groups split too) and the same with one KV head, where TP 2
exceeds the KV heads: megatron-core's attention gathers the fused QKV projection over the group
and each rank takes its query heads and their shared key/value (decoder._gather_kv does the same
in the engine, prefill and decode)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.tiny import FP32, QUESTIONS, init_layout, spawned_rank

TOKENS = 24


def cycle(checkpoint: Path, parallel_cfg) -> dict:
    """Greedy rows (two samples of one prompt: the shared prefill) and their packed logprobs."""
    from transformers import AutoTokenizer

    from rlflow.model.build import load_policy
    from tests.tiny import greedy, megatron_generation, packed_logprobs, right_padded, text_prompt

    policy = load_policy(checkpoint, FP32, parallel_cfg, trainable=False)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = [text_prompt(tokenizer, q, f"q{i}") for i, q in enumerate(QUESTIONS)]
    rows = [prompts[0], prompts[0], prompts[1], prompts[2]]
    engine = megatron_generation(policy, tokenizer.pad_token_id)
    completions = engine.generate(rows, greedy(TOKENS, tokenizer.eos_token_id))
    full = [list(r.token_ids) + list(c.token_ids) for r, c in zip(rows, completions)]
    ids, mask = right_padded(full, 0)
    with torch.no_grad():
        lp = packed_logprobs(policy, ids, mask, mask[:, 1:] & mask[:, :-1])
    return {
        "tokens": [c.token_ids for c in completions],
        "logprobs": [c.logprobs for c in completions],
        "trainer": lp.detach(),
    }


def _rank(rank: int, checkpoint: str, out: str, port: int) -> None:
    spawned_rank(rank, 2, port)
    from rlflow import parallel
    from rlflow.recipe.schema import ParallelismConfig

    layout = ParallelismConfig(2, 1, 1, 1, "off")
    init_layout(layout)
    result = cycle(Path(checkpoint), layout)
    if rank == 0:
        torch.save(result, out)
    parallel.shutdown()


@pytest.fixture(scope="module")
def checkpoints(family_ckpt, tmp_path_factory):
    from rlflow.model.families.nemotron_h import PRESETS, write_tiny_nemotron_h

    one_kv = dataclasses.replace(PRESETS["tiny-nemotron-h"], kv_heads=1)
    folder = tmp_path_factory.mktemp("nemotron-h-1kv")
    return {
        "kv2": family_ckpt("tiny-nemotron-h"),
        "kv1": write_tiny_nemotron_h(folder, seed=0, lm_head_scale=8.0, sizes=one_kv),
    }


@pytest.mark.parametrize("case", ["kv2", "kv1"])
def test_tensor_parallel_2_equals_one_rank(single_rank, checkpoints, case, tmp_path):
    import torch.multiprocessing as mp

    from rlflow.parallel import _free_port
    from tests.tiny import SINGLE

    checkpoint = checkpoints[case]
    reference = cycle(checkpoint, SINGLE)
    out = tmp_path / "rank0.pt"
    mp.start_processes(
        _rank, args=(str(checkpoint), str(out), _free_port()), nprocs=2, start_method="spawn"
    )
    result = torch.load(out)
    assert result["tokens"] == reference["tokens"]
    assert all(len(t) == TOKENS for t in result["tokens"])
    for got, want in zip(result["logprobs"], reference["logprobs"]):
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert (result["trainer"] - reference["trainer"]).abs().max() < 1e-4
