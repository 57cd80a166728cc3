"""rlflow's engine on a mixture-of-experts model (the tiny Qwen3-MoE, fp32 on the CPU): greedy
tokens and logprobs as HF's, as the trainer's, the GRPO shape (shared prompts, retired rows,
batch size) unchanged, and the routing it records is the trainer's own (router replay)."""

from __future__ import annotations

import pytest
import torch

from rlflow.generation.base import Prompt, SamplingParams
from rlflow.model.media import Media
from tests.tiny import FP32, SINGLE, greedy, megatron_generation

QUESTIONS = [
    "How many red squares are there?",
    "Count.",
    "A picture shows a large blue triangle and a small red circle. How many circles?",
    "What is the number of cubes?",
]
G = 3


@pytest.fixture(scope="module")
def moe(single_rank, tmp_path_factory):
    from transformers import AutoTokenizer

    from rlflow.model.build import load_policy
    from rlflow.model.families.qwen3_moe import write_tiny_qwen3_moe

    path = write_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3moe-gen"), seed=0, lm_head_scale=8.0)
    policy = load_policy(path, FP32, SINGLE, trainable=False)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = []
    for i, question in enumerate(QUESTIONS):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append(Prompt(f"text-{i}", text, tuple(ids), Media()))
    return policy, tokenizer, prompts


def _engine(moe, **kwargs):
    policy, tokenizer, _ = moe
    return megatron_generation(policy, tokenizer.pad_token_id, **kwargs)


def sampled(n: int, stop: tuple[int, ...] = (-1,), seed: int = 5) -> SamplingParams:
    return SamplingParams(n, 1.0, 1.0, 0, seed, stop, ignore_eos=stop == (-1,))


def test_greedy_tokens_and_logprobs_match_hf(moe):
    from rlflow.generation.hf import HFGeneration

    policy, tokenizer, prompts = moe
    params = greedy(12, tokenizer.eos_token_id)
    ours = _engine(moe, max_batch_size=8).generate(prompts, params)
    ref = HFGeneration(policy, tokenizer.pad_token_id, 8).generate(prompts, params)
    for a, b in zip(ours, ref):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_the_grpo_shape_never_changes_tokens(moe):
    _, _, prompts = moe
    rows = [p for p in prompts for _ in range(G)]
    shared = _engine(moe).generate(rows, sampled(16))
    unshared = _engine(moe, share_prompts=False).generate(rows, sampled(16))
    chunked = _engine(moe, max_batch_size=G).generate(rows, sampled(16))
    tokens = [c.token_ids for c in shared]
    assert tokens == [c.token_ids for c in unshared] == [c.token_ids for c in chunked]
    for a, b in zip(shared, unshared):
        assert torch.equal(a.routing, b.routing)
    # a stop token some rows sample early retires them; the other rows go on unchanged
    counts = {t: sum(t in r[:8] for r in tokens) for r in tokens for t in r[:8]}
    stop = max((t for t, c in counts.items() if 0 < c < len(rows) // 2), key=counts.get)
    stopped = _engine(moe).generate(rows, sampled(16, stop=(stop,)))
    for before, after, full in zip(tokens, stopped, shared):
        cut = before.index(stop) + 1 if stop in before else len(before)
        assert after.token_ids == before[:cut]
        prompt = len(after.routing) - len(after.token_ids)
        recorded = after.routing[: prompt + cut - 1]  # every token that went through the model
        assert torch.equal(recorded, full.routing[: prompt + cut - 1])
        assert (recorded >= 0).all()


def test_generation_equals_the_trainer_and_records_its_routing(moe):
    """The trainer's logprobs of sampled rollouts equal the engine's in fp32, and the experts
    the engine recorded for every token are the trainer's own choice (agreement 1)."""
    from rlflow.model.moe import routing
    from rlflow.train.rollouts import build_train_batch
    from rlflow.train.update import Batching, rollout_logprobs

    policy, tokenizer, prompts = moe
    rows = [p for p in prompts for _ in range(G)]
    completions = _engine(moe).generate(rows, sampled(16))
    batch = build_train_batch(
        rows, completions, [0.0] * len(rows), prompt_ids=policy.prompt_ids, pad_token_id=0
    )
    assert batch.routing is not None and batch.routing.shape[2:] == (2, 2)
    for replay in (False, True):
        trainer, _ = rollout_logprobs(
            policy,
            batch,
            Batching(4, max_tokens=0, packed=True),
            with_entropy=False,
            router_replay=replay,
        )
        mask = batch.target_mask
        assert (trainer[mask] - batch.gen_logprobs[mask]).abs().max() < 1e-5
        metrics = routing.step_metrics(policy)
        assert metrics["moe/routing_agreement"] == 1.0
        assert 1.0 <= metrics["moe/load_spread"] < 8.0


def test_replay_routes_tokens_to_the_recorded_experts(moe):
    """Replaying other experts than the router's changes the trainer's logprobs; with replay
    off the agreement metric reports exactly the share of pairs that were left unchanged (with
    it on, later layers see other hidden states, so their own choices move too)."""
    from rlflow.model.moe import routing
    from rlflow.train.rollouts import build_train_batch
    from rlflow.train.update import Batching, rollout_logprobs

    policy, tokenizer, prompts = moe
    completions = _engine(moe).generate(prompts, sampled(8))
    batch = build_train_batch(
        prompts, completions, [0.0] * len(prompts), prompt_ids=policy.prompt_ids, pad_token_id=0
    )
    known = batch.routing[..., 0] >= 0  # [N, L, layers]
    changed = known.clone()
    changed[:, ::2] = False  # every other position keeps the recorded experts
    # a permutation of the experts: every changed token x layer gets a different expert set
    batch.routing[changed] = (batch.routing[changed] + 3) % 8
    mask = batch.target_mask
    results = {}
    for replay in (False, True):
        results[replay], _ = rollout_logprobs(
            policy,
            batch,
            Batching(8, max_tokens=0, packed=True),
            with_entropy=False,
            router_replay=replay,
        )
        metrics = routing.step_metrics(policy)
        if not replay:
            expected = 1 - changed.sum().item() / known.sum().item()
            assert abs(metrics["moe/routing_agreement"] - expected) < 1e-9
    assert (results[False][mask] - batch.gen_logprobs[mask]).abs().max() < 1e-5
    assert (results[True][mask] - batch.gen_logprobs[mask]).abs().max() > 1e-2


def test_one_minibatch_update_counts_the_routing_once(moe, tmp_path):
    """With one mini-batch the update's forward stands in for the old-logprob pass (the loop
    skips that pass): the step's routing statistics are the ones that pass gives, counted once;
    after a real pass the update's forwards add nothing to them."""
    from pathlib import Path

    from rlflow.model.build import load_policy
    from rlflow.model.families.qwen3_moe import write_tiny_qwen3_moe
    from rlflow.model.moe import routing
    from rlflow.recipe.load import load_recipe
    from rlflow.train.rollouts import build_train_batch
    from rlflow.train.update import Batching, rollout_logprobs
    from tests.tiny import recipe_update

    _, _, prompts = moe
    path = write_tiny_qwen3_moe(tmp_path, seed=0, lm_head_scale=8.0)  # the fixture's weights
    policy = load_policy(path, FP32, SINGLE, trainable=True)
    rows = [p for p in prompts for _ in range(G)]
    completions = _engine(moe).generate(rows, sampled(16))
    advantages = torch.linspace(-1, 1, len(rows)).tolist()
    batch = build_train_batch(
        rows, completions, advantages, prompt_ids=policy.prompt_ids, pad_token_id=0
    )
    recipe_file = Path(__file__).parents[2] / "recipes" / "tiny-qwen3-moe-text-1n1g-cpu.yaml"
    recipe = load_recipe(recipe_file, ["optimizer.lr=0", "loss.kl_penalty=0"]).recipe
    batching = Batching(4, max_tokens=0, packed=True)

    def update(old_logprobs):
        return recipe_update(
            policy, batch, recipe, old_logprobs=old_logprobs, ref_logprobs=None, batching=batching
        )

    old, _ = rollout_logprobs(policy, batch, batching, with_entropy=False, router_replay=False)
    update(old)  # the two-pass step: the pass counts, the update's forwards do not
    two_pass = routing.step_metrics(policy)
    update(None)  # the one-pass step
    one_pass = routing.step_metrics(policy)
    assert two_pass["moe/routing_agreement"] == 1.0
    routed = [k for k in two_pass if k != "moe/aux_loss"]
    assert routed and {k: one_pass[k] for k in routed} == {k: two_pass[k] for k in routed}


@pytest.mark.parametrize(
    ("dtype", "hidden", "ffn", "nemotron"),
    [
        (torch.float32, 32, 16, False),
        (torch.bfloat16, 12, 6, False),
        (torch.float32, 32, 16, True),
        (torch.bfloat16, 12, 6, True),
    ],
    ids=["float32", "bfloat16-unaligned", "nemotron-float32", "nemotron-bfloat16-unaligned"],
)
def test_moe_decode_never_reads_the_gpu_from_the_host(dtype, hidden, ffn, nemotron):
    """The decode step is replayed as a CUDA graph (generation.cuda_graphs), and a host read of
    a GPU tensor fails its capture: an fp32 tiny MoE recipe stopped in its first rollout there.
    CUDA tensors of torch's FakeTensorMode (shapes and devices, no data, no GPU needed) raise on
    every host read (.tolist(), .item(), .cpu()), and torch's grouped kernel accepts them only
    where its CUDA build runs without one (bfloat16), so the layer must run on them in every
    dtype a recipe can choose: Qwen3-MoE's (softmax router, SwiGLU experts) and Nemotron-H's
    (sigmoid router with expert bias, 2 groups, scaling; squared-ReLU experts; a shared
    expert)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rlflow.generation.megatron.moe_decode import MoEWeights, moe_mlp

    experts, rows = 4, 6
    with FakeTensorMode():

        def cuda(*shape, dtype=dtype):
            return torch.empty(shape, dtype=dtype, device="cuda")

        if nemotron:
            router = dict(
                expert_bias=cuda(experts, dtype=torch.float32), score_function="sigmoid",
                scaling=2.5, num_groups=2, group_topk=1, router_dtype=torch.float32,
                activation="relu2", fc1=cuda(experts, ffn, hidden),
                shared_fc1=cuda(3 * ffn, hidden), shared_fc2=cuda(hidden, 3 * ffn),
            )  # fmt: skip
        else:
            router = dict(
                expert_bias=None, score_function="softmax", scaling=None, num_groups=None,
                group_topk=None, router_dtype=None, activation="swiglu",
                fc1=cuda(experts, 2 * ffn, hidden), shared_fc1=None, shared_fc2=None,
            )  # fmt: skip
        weights = MoEWeights(
            norm=cuda(hidden), router=cuda(experts, hidden), router_bias=None,
            fc2=cuda(experts, hidden, ffn), first=0, topk=2, pre_softmax=False, ep_group=None,
            **router,
        )  # fmt: skip
        out, chosen = moe_mlp(cuda(rows, hidden), weights, eps=1e-6)
        assert out.device.type == "cuda" and out.shape == (rows, hidden) and out.dtype == dtype
        assert chosen.shape == (rows, 2)
