"""The serving engine's continuous batching against `generate()`: same prompts, same seeds, same
tokens, whichever requests share the batch and whenever they join it."""

from __future__ import annotations

import pytest

from rlflow.generation.base import SamplingParams
from rlflow.serve.requests import Request
from tests.tiny import greedy, make_prompt, megatron_generation, mixed_prompts


@pytest.fixture(scope="module")
def engine(server):
    """The shared server's engine (tests/serve/conftest.py): 4 rows, a 64-token prefill budget."""
    return server.served.engine


def _request(policy, prompt, params, seeds):
    return Request(prompt, policy.prompt_ids(prompt), params, list(seeds))


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_requests_joining_a_running_batch_draw_what_generate_draws(
    engine, tiny_policy, tiny_processor, temperature
):
    """Eight rows (4 prompts x 2 samples) through a 4-row batch with a 64-token prefill budget:
    rows join as others retire, one prompt's two samples share a prefill."""
    from rlflow.generation.megatron.sampling import row_seeds

    eos = tiny_processor.tokenizer.eos_token_id
    prompts = mixed_prompts(tiny_processor)
    rows = [p for p in prompts for _ in range(2)]
    params = SamplingParams(
        12, temperature, 0.9 if temperature == 0.7 else 1.0, 0, 5, (eos,), False
    )
    expected = megatron_generation(tiny_policy, 0).generate(rows, params)
    seeds = row_seeds(params.seed, len(rows), "cpu").tolist()
    # different max_tokens per request: rows retire at different steps, others take their place
    requests = [
        _request(tiny_policy, p, params, seeds[2 * i : 2 * i + 2]) for i, p in enumerate(prompts)
    ]
    for r in requests:
        engine.submit(r)
    for r in requests:
        assert r.wait(60) and r.error is None
    got = [c for r in requests for c in r.choices]
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert engine.stats.prefills > 1  # not one fixed batch


def test_one_prompt_of_separate_requests_is_prefilled_once(engine, tiny_policy, tiny_processor):
    """Two requests carrying one prompt (what the server's prompt cache hands identical
    requests) join in one prefill; greedy, each draws what the prompt alone draws through
    generate() without sharing."""
    eos = tiny_processor.tokenizer.eos_token_id
    prompt = make_prompt(tiny_processor, "image", "How many red squares are there?", seed=1)
    params = greedy(8, eos)
    [alone] = megatron_generation(tiny_policy, 0, share_prompts=False).generate([prompt], params)
    twins = [_request(tiny_policy, prompt, params, [seed]) for seed in (3, 4)]
    prefills = engine.stats.prefills
    with engine._cond:  # (the engine admits under this lock: both wait for the same check)
        for request in twins:
            engine.submit(request)
    for request in twins:
        assert request.wait(60) and request.error is None
    assert engine.stats.prefills == prefills + 1
    assert [r.choices[0].token_ids for r in twins] == [alone.token_ids] * 2


def test_hybrid_rows_joining_as_others_retire_draw_what_generate_draws(hybrid_policy):
    """Tiny Nemotron-H: six one-choice requests through a 3-row batch, each stopping at its own
    max_tokens, so rows join as others retire and take the Mamba state slots they gave back:
    each draws generate()'s row (a later row's slot starts from zeros, not from a retired row's
    state)."""
    import dataclasses

    from rlflow.generation.megatron.sampling import row_seeds
    from rlflow.serve.engine import ServingEngine
    from tests.tiny import text_prompt

    policy, tokenizer, _ = hybrid_policy
    questions = ["How many red squares are there?", "Count.", "How many circles are there?"]
    prompts = [text_prompt(tokenizer, q) for q in questions for _ in range(2)]
    params = SamplingParams(12, 1.0, 1.0, 0, 9, (-1,), True)
    expected = megatron_generation(policy, 0, share_prompts=False).generate(prompts, params)
    seeds = row_seeds(params.seed, len(prompts), "cpu").tolist()
    engine = ServingEngine(
        policy, tokenizer.pad_token_id, max_rows=3, context_tokens=256, cache_tokens=0,
        cuda_graphs=False, compile_decode=False, on_weight_update="finish_old",
        max_prefill_tokens=64,
    )  # fmt: skip
    try:
        lengths = [12, 3, 9, 5, 12, 7]
        requests = [
            _request(policy, p, dataclasses.replace(params, max_new_tokens=n), [s])
            for p, n, s in zip(prompts, lengths, seeds)
        ]
        for r in requests:
            engine.submit(r)
        for r in requests:
            assert r.wait(60) and r.error is None
    finally:
        engine.close()
    for r, want, n in zip(requests, expected, lengths):
        assert r.choices[0].token_ids == want.token_ids[:n]
    assert engine.stats.prefills > 1
