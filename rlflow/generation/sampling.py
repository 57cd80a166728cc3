"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling with a seed."""

from __future__ import annotations

import torch

from rlflow.generation.base import SamplingParams


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [B, V] (fp32) -> tokens [B]. temperature 0 is greedy (argmax, first index on ties)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
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
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
