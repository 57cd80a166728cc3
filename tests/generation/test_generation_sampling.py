"""Sampling: per-row counter-based draws, the two-level inverse CDF, and its distribution."""

from __future__ import annotations

import torch

from rlflow.generation.base import SamplingParams
from rlflow.generation.megatron.sampling import _sample_plain, row_seeds, sample_tokens, uniforms


def params(temperature=1.0, top_p=1.0, top_k=0) -> SamplingParams:
    return SamplingParams(8, temperature, top_p, top_k, 0, (), False)


def test_draws_depend_on_the_row_seed_and_step_only():
    seeds = row_seeds(7, 64, "cpu")
    assert len(set(seeds.tolist())) == 64
    u = uniforms(seeds, 3)
    assert torch.equal(uniforms(seeds[10:20], 3), u[10:20])  # a row alone draws the same
    assert not torch.equal(uniforms(seeds, 4), u)
    assert bool(((u >= 0) & (u < 1)).all())


def test_two_level_inverse_cdf_equals_the_full_cdf():
    torch.manual_seed(0)
    logits = torch.randn(256, 5003) * 3  # vocab not a multiple of the block: padding in play
    seeds = row_seeds(1, 256, "cpu")
    fast, fast_lp = _sample_plain(logits, uniforms(seeds, 0))
    # the generic path (a filter that keeps everything) inverts the full-vocabulary CDF
    full, full_lp = sample_tokens(logits, params(top_k=10**6, top_p=0.9999999), seeds, 0)
    assert (fast == full).float().mean() >= 0.99  # equal up to float rounding at boundaries
    reference = torch.log_softmax(logits, -1).gather(1, fast[:, None])[:, 0]
    assert torch.allclose(fast_lp, reference, atol=1e-5)
    assert torch.allclose(full_lp, torch.log_softmax(logits, -1).gather(1, full[:, None])[:, 0])


def test_two_level_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0, -3.0]]).repeat(20000, 1)
    token, _ = sample_tokens(logits, params(), row_seeds(3, 20000, "cpu"), 0)
    freq = torch.bincount(token, minlength=5).float() / 20000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.01)


def test_greedy_takes_the_argmax_with_its_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 5.0, 0.0]])
    token, lp = sample_tokens(logits, params(temperature=0.0), row_seeds(0, 2, "cpu"), 0)
    assert token.tolist() == [1, 0]
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, token[:, None])[:, 0])
