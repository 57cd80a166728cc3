"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling.

Randomness is *per row*: row r's draw at step s is a hash of (its seed, s), one uniform number
inverted through the row's CDF. A row's tokens therefore never depend on which other rows share
its batch, on the batch's order, or on rows that finished and left it; that is what lets the
engine share prompts, retire finished rows and resize its batch without changing a single token.
"""

from __future__ import annotations

import torch

from rlflow.generation.base import SamplingParams

_MASK31 = 0x7FFFFFFF


def row_seeds(seed: int, rows: int, device) -> torch.Tensor:
    """One 31-bit seed per row of a generate call, from the call's seed and the row index."""
    index = torch.arange(rows, dtype=torch.long, device=device)
    return _hash(_hash(torch.full_like(index, seed & _MASK31)) ^ index)


def uniforms(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """[rows] float64 in [0, 1): the rows' draws at `step` (53 random bits each); `step` may be
    a tensor [rows] of per-row steps (the server's rows start at different times)."""
    counter = 2 * step + 1
    if not isinstance(counter, torch.Tensor):
        counter = torch.full_like(seeds, counter)
    high = _hash(seeds ^ _hash(counter))
    low = _hash(high ^ 0x5BD1E995)
    return (high.double() * 2**22 + (low >> 9).double()) / 2.0**53


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, step: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (fp32) -> (tokens [B], their logprobs [B] under the unmodified distribution).

    temperature 0 is greedy (argmax, first index on ties).
    """
    if params.temperature == 0:
        token = logits.argmax(dim=-1)
        return token, logits.gather(1, token[:, None])[:, 0] - logits.logsumexp(-1)
    if params.temperature == 1 and params.top_k == 0 and params.top_p >= 1.0:
        return _sample_plain(logits, uniforms(seeds, step))
    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # drop a token when the tokens ranked above it already cover top_p; the best one always stays
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    cdf = torch.softmax(scores, dim=-1).cumsum(dim=-1)
    target = (uniforms(seeds, step) * cdf[:, -1].double()).to(cdf.dtype)
    token = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
    return token, logits.gather(1, token[:, None])[:, 0] - logits.logsumexp(-1)


_BLOCK = 2048  # vocabulary block of the two-level inverse CDF


def _sample_plain(logits: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """T=1 sampling by a two-level inverse CDF: per-block sums locate the block, then one
    block's cumulative sum locates the token. Three passes over [B, V] instead of a full-vocab
    softmax, cumsum and logsumexp; the same exponentials give the logprob's normaliser."""
    rows, vocab = logits.shape
    blocks = -(-vocab // _BLOCK)
    weights = logits.new_zeros(rows, blocks * _BLOCK)
    top = logits.amax(dim=-1, keepdim=True)
    torch.sub(logits, top, out=weights[:, :vocab]).exp_()  # exp(logit - max); padding stays 0
    weights = weights.view(rows, blocks, _BLOCK)
    block_sums = weights.sum(-1)  # [B, blocks]
    cumulative = block_sums.cumsum(-1)
    total = cumulative[:, -1]
    target = (u * total.double()).to(total.dtype)[:, None]
    block = torch.searchsorted(cumulative, target, right=True).clamp_(max=blocks - 1)  # [B, 1]
    before = cumulative.gather(1, block) - block_sums.gather(1, block)
    inner = weights.gather(1, block[:, :, None].expand(rows, 1, _BLOCK))[:, 0].cumsum(-1)
    within = torch.searchsorted(inner, target - before, right=True).clamp_(max=_BLOCK - 1)
    token = (block * _BLOCK + within)[:, 0].clamp_(max=vocab - 1)
    logprob = logits.gather(1, token[:, None])[:, 0] - top[:, 0] - total.log()
    return token, logprob


def _hash(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer mix (murmur-style multiply/xor-shift rounds), exact in int64 arithmetic:
    every product stays below 2**62."""
    x = x & _MASK31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK31
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK31
    x = ((x ^ (x >> 13)) * 0x297A2D39) & _MASK31
    return x ^ (x >> 16)
