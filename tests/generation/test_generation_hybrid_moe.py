"""rlflow's Megatron engine on a hybrid model with mixture-of-experts layers (tiny Nemotron-H MoE,
pattern `ME*E-`: 8 squared-ReLU experts top-2 in 2 groups, a shared expert, sigmoid router with
the checkpoint's correction bias, scaling 2.5; fp32, CPU): 64 greedy tokens equal HF's with
HF's logprobs, equal to the trainer's packed and padded logprobs, and the experts it records are
the trainer's own choice; a prompt's samples share one prefill, rows that stop retire mid-way
and passes through a small cache (preempted rows) change no other row's tokens or routing; under
expert parallelism (2 gloo ranks, 4 experts each, in lockstep) the engine generates what one rank
holding every expert generates."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from rlflow.model.media import Media
from tests.tiny import (
    completion_rows,
    frozen_policy,
    greedy,
    greedy_batch_equals_hf,
    init_layout,
    megatron_generation,
    packed_logprobs,
    prefill_sharing_changes_nothing,
    spawned_rank,
    text_prompts,
    token_ids,
)

MOE_LAYERS = (1, 3)  # the `E`s of `ME*E-`


@pytest.fixture(scope="module")
def hybrid_moe(single_rank, family_ckpt):
    policy, tokenizer = frozen_policy(family_ckpt("tiny-nemotron-h-moe"))
    prompts = text_prompts(tokenizer)
    return policy, tokenizer, prompts


def _engine(hybrid_moe, **changes):
    policy, tokenizer, _ = hybrid_moe
    return megatron_generation(policy, tokenizer.pad_token_id, **changes)


def test_greedy_equals_hf_for_64_tokens_and_the_trainers_logprobs_and_routing(hybrid_moe):
    """Prompts of different lengths, 2 samples of two of them, in one batch: each row's 64 greedy
    tokens are HF's, its logprobs HF's, the packed and the padded trainer's; the recorded experts
    are -1 outside the MoE layers and the trainer's own choice in them (agreement 1); with a stop
    token some rows draw, those rows end there and the others draw what they drew."""
    from rlflow.model.forward import policy_logits
    from rlflow.model.moe import routing
    from rlflow.train.rollouts import build_train_batch
    from rlflow.train.update import Batching, rollout_logprobs

    policy, tokenizer, prompts = hybrid_moe
    rows, ours = greedy_batch_equals_hf(_engine(hybrid_moe), policy, tokenizer, prompts)
    assert len({tuple(t) for t in token_ids(ours)}) == 3  # the prompts' continuations differ

    # the trainer's forwards over prompt + completion score the same logprobs
    unique = [ours[0], ours[2], ours[3]]
    ids, mask, targets = completion_rows(prompts, unique, tokenizer.pad_token_id)
    engine_lp = torch.tensor([x for c in unique for x in c.logprobs])
    with torch.no_grad():
        trainer = packed_logprobs(policy, ids, mask, targets)
        logits = policy_logits(policy.core, ids, mask, Media())
    padded = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])[..., 0]
    assert (trainer - engine_lp).abs().max() < 1e-4
    assert (padded[targets] - engine_lp).abs().max() < 1e-4
    assert float(torch.exp((trainer - engine_lp).abs().mean())) < 1.0 + 1e-5

    # router replay: every token's experts, in the trainer's router numbering (the whole stack)
    for row, completion in zip(rows, ours):
        recorded = completion.routing  # [prompt + generated, layers, k]
        assert recorded.shape == (len(row.token_ids) + 64, 5, 2)
        dense = [i for i in range(5) if i not in MOE_LAYERS]
        assert (recorded[:-1, dense] == -1).all() and (recorded[:-1, MOE_LAYERS] >= 0).all()
        assert (recorded[-1] == -1).all()  # the last token never went through the model
    assert torch.equal(ours[0].routing, ours[1].routing)  # greedy samples of one prompt
    batch = build_train_batch(
        rows, ours, [0.0] * len(rows), prompt_ids=policy.prompt_ids, pad_token_id=0
    )
    for replay in (False, True):
        trainer, _ = rollout_logprobs(
            policy, batch, Batching(5, max_tokens=0, packed=True), with_entropy=False,
            router_replay=replay,
        )  # fmt: skip
        target = batch.target_mask
        assert (trainer[target] - batch.gen_logprobs[target]).abs().max() < 1e-4
        assert routing.step_metrics(policy)["moe/routing_agreement"] == 1.0

    # a stop token some rows draw (not all): they retire mid-generation, the rest run on
    tokens = token_ids(ours)
    counts = {t: sum(t in r[:40] for r in tokens) for r in tokens for t in r[8:40]}
    stop = next(t for t, c in sorted(counts.items()) if 0 < c < len(rows) - 1)
    stopped = _engine(hybrid_moe).generate(
        rows, greedy(64, stop, ignore_eos=False)
    )  # fmt: skip
    ended = 0
    for before, after in zip(ours, stopped):
        cut = before.token_ids.index(stop) + 1 if stop in before.token_ids else 64
        ended += cut < 64
        assert after.token_ids == before.token_ids[:cut]
        assert max(abs(x - y) for x, y in zip(after.logprobs, before.logprobs)) < 1e-5
        prompt = len(before.routing) - 64
        assert torch.equal(after.routing[: prompt + cut - 1], before.routing[: prompt + cut - 1])
    assert 0 < ended < len(rows)


def test_shared_prefill_and_passes_never_change_a_rows_tokens_or_experts(hybrid_moe):
    """T=1 sampling (a row's draws depend on its seed only), 3 samples of one prompt and 2 of
    another: sharing each prompt's prefill equals prefilling every row alone, and a cache so
    small that the rows run in several passes, some preempted mid-generation, changes nothing."""
    _, _, prompts = hybrid_moe
    prefill_sharing_changes_nothing(partial(_engine, hybrid_moe), prompts, routing=True)


EP_SHARES = ([0, 0], [1, 2, 2])  # each EP rank's rows (question indices): unequal on purpose


def _ep_rank(rank: int, checkpoint: str, out: str, port: int) -> None:
    spawned_rank(rank, 2, port)
    from transformers import AutoTokenizer

    from rlflow import parallel
    from rlflow.model.build import load_policy
    from rlflow.recipe.schema import ParallelismConfig
    from tests.tiny import FP32

    layout = ParallelismConfig(1, 1, 1, 2, "off")
    init_layout(layout)
    policy = load_policy(Path(checkpoint), FP32, layout, trainable=False)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = text_prompts(tokenizer)
    engine = megatron_generation(policy, tokenizer.pad_token_id)
    rows = [prompts[i] for i in EP_SHARES[rank]]
    completions = engine.generate(rows, greedy(16, tokenizer.eos_token_id))
    engine.generate([] if rank else rows[:1], greedy(4, tokenizer.eos_token_id))  # rank 1: none
    mine = [(c.token_ids, c.logprobs, c.routing) for c in completions]
    gathered = parallel.all_gather_objects(mine)
    if rank == 0:
        torch.save(gathered, out)
    parallel.shutdown()


def test_expert_parallel_ranks_generate_what_one_rank_does(hybrid_moe, family_ckpt, tmp_path):
    """EP 2: each rank keeps 4 of the 8 experts; every MoE layer of every prefill and decode step
    gathers both ranks' tokens (rank 0 has fewer prompt tokens and rows: the lockstep pads its
    prefill with a sequence that runs on the scratch Mamba slot, and its batch with finished
    rows; then rank 1 joins a pass with no rows of its own). Tokens, logprobs and recorded
    experts equal the single rank's."""
    import torch.multiprocessing as mp

    from rlflow.parallel import _free_port

    _, tokenizer, prompts = hybrid_moe
    checkpoint = family_ckpt("tiny-nemotron-h-moe")
    out = tmp_path / "rank0.pt"
    mp.start_processes(
        _ep_rank, args=(str(checkpoint), str(out), _free_port()), nprocs=2, start_method="spawn"
    )
    gathered = torch.load(out)
    reference = _engine(hybrid_moe).generate(
        [prompts[i] for share in EP_SHARES for i in share], greedy(16, tokenizer.eos_token_id)
    )
    ours = [row for part in gathered for row in part]
    assert len(ours) == len(reference)
    for (tokens, logprobs, routing), ref in zip(ours, reference):
        assert tokens == ref.token_ids
        assert max(abs(a - b) for a, b in zip(logprobs, ref.logprobs)) < 1e-5
        assert torch.equal(routing, ref.routing)
