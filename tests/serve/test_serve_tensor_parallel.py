"""A tensor-parallel engine behind the server (rlflow/serve/tensor_parallel.py), on two gloo
ranks of the tiny Nemotron-H (Mamba-2 + attention + MLP, fp32, CPU): rank 0 serves real HTTP
and sends its plans, rank 1 follows them. Concurrent requests through the `openai` client (rows
joining and leaving the running batch, rows preempted by a full cache, a request's two choices,
a stop string only the leader's tokenizer sees) get the same greedy tokens as the same requests on a one-rank server; an idle
leader's empty plans (heartbeats) and its end plan reach the follower."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tests.serve.conftest import SERVER_KEYS
from tests.tiny import FP32, QUESTIONS, base_recipe, init_layout, spawned_rank

# 3 rows for 5 requests (6 choices): requests wait, join as rows retire, and share batches;
# a cache of 8 blocks of 16 tokens holds fewer than 3 whole rows: the last admitted give way
# (preempted) and run again later, on both ranks alike.
KEYS = {**SERVER_KEYS, "max_rows": 3, "context_tokens": 128}
CACHE_TOKENS = 128


def _recipe():
    recipe = base_recipe()
    gen = recipe.generation
    server = dataclasses.replace(gen.server, **KEYS)
    gen = dataclasses.replace(gen, server=server, kv_cache_tokens=CACHE_TOKENS)
    return dataclasses.replace(recipe, generation=gen)


def ask(url: str) -> list[list[list[int]]]:
    """Each request's choices' token ids: one request alone, then five at once, one of them
    stopped by a piece of the first one's text."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    def create(question: str, max_tokens: int, n: int = 1, stop=None) -> list[list[int]]:
        completion = client.chat.completions.create(
            model="tp", messages=[{"role": "user", "content": question}], n=n,
            max_tokens=max_tokens, temperature=0.0, stop=stop, logprobs=True, top_logprobs=0,
            extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        return [
            [int(t.token.removeprefix("token_id:")) for t in c.logprobs.content]
            for c in completion.choices
        ]

    first = create(QUESTIONS[0], 16)
    text = client.chat.completions.create(
        model="tp", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=16,
        temperature=0.0,
    ).choices[0].message.content  # fmt: skip
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    asks = [
        (QUESTIONS[1], 48, 2, None),
        (QUESTIONS[2], 7, 1, None),
        (QUESTIONS[0], 16, 1, [stop]),
        (QUESTIONS[1], 40, 1, None),
        (QUESTIONS[2], 44, 1, None),
    ]
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda a: create(*a), asks))
    return [first, *answers]


def _rank(rank: int, checkpoint: str, out: str, port: int) -> None:
    spawned_rank(rank, 2, port)
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rlflow import parallel
    from rlflow.model.build import load_policy
    from rlflow.recipe.schema import ParallelismConfig
    from rlflow.serve.runner import ServerThread, following_engine, served_engine
    from rlflow.serve.tensor_parallel import PlanSender

    layout = ParallelismConfig(2, 1, 1, 1, "off")
    init_layout(layout)
    group = parallel.CrossGroup(dist.new_group([0, 1], backend="gloo"), (0, 1), torch.device("cpu"))
    policy = load_policy(Path(checkpoint), FP32, layout, trainable=False)
    recipe = _recipe()
    if rank == 0:
        from rlflow.serve import engine
        from tests.serve.conftest import wait_until

        engine.PLAN_HEARTBEAT_S = 0.05  # (60 s in a job)
        sender = PlanSender(group)
        served = served_engine(policy, Path(checkpoint), recipe, "tp", plans=sender)
        served.engine.resume_followers()  # rank 1 follows from now on
        thread = ServerThread(served, "127.0.0.1", 0, 16, 30).start()
        try:
            answers = ask(thread.url)
            sent = sender.sent  # idle now: empty plans keep the follower's wait short
            wait_until(lambda: sender.sent >= sent + 3, "three heartbeat plans")
            served.engine.release_followers()
        finally:
            thread.stop()
        stats = served.engine.stats
        result = {"answers": answers, "plans": sender.sent, "preempted": stats.preempted}
        Path(out).write_text(json.dumps(result))
    else:
        pad = AutoTokenizer.from_pretrained(checkpoint).pad_token_id
        follower = following_engine(policy, pad, recipe, group)
        follower.follow()
        Path(out + ".follower").write_text(json.dumps({"plans": follower.plans}))
    parallel.shutdown()


def test_a_tensor_parallel_engine_serves_what_one_rank_serves(hybrid_policy, tmp_path):
    import torch.multiprocessing as mp

    from rlflow.parallel import _free_port
    from rlflow.serve.runner import ServerThread, served_engine

    policy, _, checkpoint = hybrid_policy
    served = served_engine(policy, checkpoint, _recipe(), "tp")
    thread = ServerThread(served, "127.0.0.1", 0, 16, 30).start()
    try:
        reference = ask(thread.url)
    finally:
        thread.stop()
    out = tmp_path / "tp.json"
    mp.start_processes(
        _rank, args=(str(checkpoint), str(out), _free_port()), nprocs=2, start_method="spawn"
    )
    got = json.loads(out.read_text())
    assert got["answers"] == reference
    assert got["preempted"] > 0  # (the tokens do not depend on it)
    assert [len(c) for c in reference[1]] == [48, 48]  # (greedy: two equal choices)
    assert len(reference[3][0]) < 16  # the stop string cut it
    followed = json.loads((tmp_path / "tp.json.follower").read_text())["plans"]
    assert followed == got["plans"] > 6  # every plan, the step's end included
