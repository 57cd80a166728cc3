"""Expert parallelism on gloo ranks (the tiny Qwen3-MoE, 8 experts, fp32 on the CPU): the
engine serving EP ranks in lockstep, and the trainer's logprobs, loss and gradients, equal to
one rank holding every expert.

Each case runs one rollout + logprob + backward cycle: the ranks generate their data-parallel
share of the prompts (unequal shares: the lockstep pads), the trainer recomputes the rollouts'
logprobs with router replay, then one policy-gradient backward and megatron's gradient
reduction; the gradients are exported through megatron-bridge as full HF tensors (which
gathers the tensor- and expert-parallel shards). Reference: the same cycle on this process's
single rank. Cases: TP 2 x EP 2 on 4 ranks (2 data-parallel ranks of EP 2, 4 experts a
rank, the experts split over TP too: megatron-core's expert-tensor-parallel size is the TP
size; its dispatcher's unequal per-TP-rank gathers run through rlflow/compat/cpu_compat.py on
gloo), and EP 4 on 4 ranks without TP, where the 5 prompts give rank 0 two logprob
micro-batches and the others one: the trainer's forwards stay in lockstep
(rlflow/train/update.py `lockstep_parts`; it hung before). Together they hold what EP 2 on 2
ranks would (EP without TP; EP 2 with data parallelism), so that case is not run on its own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.tiny import FP32, init_layout, spawned_rank

QUESTIONS = [
    "How many red squares are there?",
    "Count.",
    "A picture shows a large blue triangle and a small red circle. How many circles?",
    "What is the number of cubes?",
    "How many spheres?",
]
G = 2


def cycle(checkpoint: Path, parallel_cfg) -> dict:
    """Generate, recompute logprobs, backward once; everything rank 0 needs to compare."""
    from megatron.core.distributed import finalize_model_grads
    from transformers import AutoTokenizer

    from rlflow import parallel
    from rlflow.generation.base import Prompt
    from rlflow.model.build import export_hf_state_dict, load_policy
    from rlflow.model.media import Media
    from rlflow.train.rollouts import build_train_batch
    from rlflow.train.update import Batching, _backward, policy_token_logprobs, rollout_logprobs
    from tests.tiny import greedy, megatron_generation

    info = parallel.info()
    # no load-balancing loss: megatron-core computes it over each rank's own tokens, which is
    # not linear in the split (its gradient would differ from one rank's by ~1e-4)
    model_cfg = dataclasses.replace(FP32, moe=dataclasses.replace(FP32.moe, aux_loss_coeff=0.0))
    policy = load_policy(checkpoint, model_cfg, parallel_cfg, trainable=True)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = []
    for i, question in enumerate(QUESTIONS[info.dp_rank :: info.dp_size]):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        prompts.append(Prompt(f"q{info.dp_rank + i * info.dp_size}", text, ids, Media()))
    rows = [p for p in prompts for _ in range(G)]
    engine = megatron_generation(policy, tokenizer.pad_token_id)
    # a stop token that ends some rows early: the engine retires them, the lockstep follows
    completions = engine.generate(rows, greedy(12, eos=107, ignore_eos=False))
    engine.generate([], greedy(4, eos=107))  # a rank with nothing to do still joins its peers
    # advantages by row identity (question, sample): the same on any split of the prompts
    advantages = [(int(row.sample_id[1:]) - 2) / 2 + 0.1 * (i % G) for i, row in enumerate(rows)]
    batch = build_train_batch(
        rows,
        completions,
        advantages,
        prompt_ids=policy.prompt_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    logprobs, _ = rollout_logprobs(
        policy,
        batch,
        Batching(3, max_tokens=0, packed=True),
        with_entropy=False,
        router_replay=True,
    )
    mask = batch.target_mask
    tokens = parallel.all_reduce_sum([float(mask.sum())], parallel.data_parallel_group())[0]
    chunk = policy.chunks[0]
    chunk.zero_grad_buffer()
    lp, _ = policy_token_logprobs(policy, batch, packed=True, router_replay=True)
    loss = -(lp * mask * batch.advantages[:, None]).sum() / tokens
    _backward(loss)
    finalize_model_grads(policy.chunks)
    with torch.no_grad():
        for param in chunk.module.parameters():
            param.copy_(param.main_grad)  # export the gradients as if they were weights
    grads = export_hf_state_dict(policy)
    rollouts = {
        row.sample_id + f"/{i % G}": (c.token_ids, c.logprobs, logprobs[i][mask[i]].tolist())
        for i, (row, c) in enumerate(zip(rows, completions))
    }
    gathered = parallel.all_gather_objects(rollouts)
    loss_total = parallel.all_reduce_sum([float(loss.detach())], parallel.data_parallel_group())[0]
    merged = {k: v for part in gathered for k, v in part.items()}
    return {"rollouts": merged, "loss": loss_total, "grads": grads}


def _rank(rank: int, world: int, tp: int, ep: int, checkpoint: str, out: str, port: int):
    spawned_rank(rank, world, port)
    from rlflow import parallel
    from rlflow.recipe.schema import ParallelismConfig

    parallel_cfg = ParallelismConfig(tp, 1, 1, ep, "off")
    init_layout(parallel_cfg)
    result = cycle(Path(checkpoint), parallel_cfg)
    if rank == 0:
        torch.save(result, out)
    parallel.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from rlflow.model.families.qwen3_moe import write_tiny_qwen3_moe

    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe-ep"), seed=0, lm_head_scale=8.0)


@pytest.fixture(scope="module")
def reference(single_rank, checkpoint):
    from tests.tiny import SINGLE

    return cycle(checkpoint, SINGLE)


@pytest.mark.parametrize(("world", "tp", "ep"), [(4, 2, 2), (4, 1, 4)])
def test_expert_parallel_equals_one_rank(reference, checkpoint, tmp_path, world, tp, ep):
    import torch.multiprocessing as mp

    from rlflow.parallel import _free_port

    out = tmp_path / "rank0.pt"
    mp.start_processes(
        _rank, args=(world, tp, ep, str(checkpoint), str(out), _free_port()), nprocs=world,
        start_method="spawn",
    )  # fmt: skip
    result = torch.load(out)
    assert sorted(result["rollouts"]) == sorted(reference["rollouts"])
    stopped = 0
    for key, (tokens, gen_lp, train_lp) in result["rollouts"].items():
        ref_tokens, ref_gen_lp, ref_train_lp = reference["rollouts"][key]
        assert tokens == ref_tokens, key  # the engine under EP generates the same tokens
        stopped += len(tokens) < 12
        assert max(abs(a - b) for a, b in zip(gen_lp, ref_gen_lp)) < 1e-5
        assert max(abs(a - b) for a, b in zip(train_lp, ref_train_lp)) < 1e-5
        assert max(abs(a - b) for a, b in zip(train_lp, gen_lp)) < 1e-5
    assert stopped  # some rows stopped early: the lockstep retired them
    assert abs(result["loss"] - reference["loss"]) < 1e-5
    assert sorted(result["grads"]) == sorted(reference["grads"])
    for name, grad in reference["grads"].items():
        assert (result["grads"][name] - grad).abs().max() < 1e-5, name
