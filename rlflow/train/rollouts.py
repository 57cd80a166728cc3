"""Rollouts -> the padded tensors the trainer's forward consumes.

One row per rollout: the (expanded) prompt tokens followed by the generated tokens, right-padded.
Logits at position t predict token t+1, so every per-token tensor here is aligned with the
*targets* input_ids[:, 1:] and has length L-1; `target_mask` is True where the target is a
generated token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlflow.generation.base import Completion
from rlflow.model.media import Media, Prompt


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L] bool
    prompt_mask: (
        torch.Tensor
    )  # [N, L] bool: prompt tokens (media pads outside it are generated text)
    target_mask: torch.Tensor  # [N, L-1] bool: target is a generated token
    gen_logprobs: torch.Tensor  # [N, L-1] generator's logprobs at generated targets, 0 elsewhere
    advantages: torch.Tensor  # [N]
    media: list[Media]  # per row
    # MoE, megatron backend: each token's experts in generation, [N, L, layers, k], -1 where
    # none (rlflow/model/moe/routing.py); with loss.router_replay the trainer routes tokens to them
    routing: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Real tokens (prompt + response) per row, no padding."""
        return self.attention_mask.sum(1).tolist()

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[:, 1:]

    def rows(self, index: slice | list[int]) -> TrainBatch:
        pick = list(range(len(self)))[index] if isinstance(index, slice) else list(index)
        batch = TrainBatch(
            input_ids=self.input_ids[pick],
            attention_mask=self.attention_mask[pick],
            prompt_mask=self.prompt_mask[pick],
            target_mask=self.target_mask[pick],
            gen_logprobs=self.gen_logprobs[pick],
            advantages=self.advantages[pick],
            media=[self.media[i] for i in pick],
            routing=None if self.routing is None else self.routing[pick],
        )
        return batch.trimmed()

    def trimmed(self) -> TrainBatch:
        """Drop padding columns every row shares (micro-batches are often shorter than the batch)."""
        width = int(self.attention_mask.sum(1).max())
        if width == self.input_ids.shape[1]:
            return self
        return TrainBatch(
            self.input_ids[:, :width],
            self.attention_mask[:, :width],
            self.prompt_mask[:, :width],
            self.target_mask[:, : width - 1],
            self.gen_logprobs[:, : width - 1],
            self.advantages,
            self.media,
            None if self.routing is None else self.routing[:, :width],
        )

    def to(self, device) -> TrainBatch:
        return TrainBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.prompt_mask.to(device),
            self.target_mask.to(device),
            self.gen_logprobs.to(device),
            self.advantages.to(device),
            self.media,
            None if self.routing is None else self.routing.to(device),
        )

    def stacked_media(self, device) -> Media:
        return Media.concat(self.media, device)


def build_train_batch(
    prompts: list[Prompt],
    completions: list[Completion],
    advantages: list[float],
    *,
    prompt_ids: Callable[[Prompt], list[int]],
    pad_token_id: int,
) -> TrainBatch:
    """Right-padded prompt+completion rows (prompts[i] produced completions[i]).

    prompt_ids: a prompt's ids as the model consumes them (`Policy.prompt_ids`)."""
    rows, starts, logprobs = [], [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = prompt_ids(prompt)
        starts.append(len(ids))
        rows.append(ids + list(completion.token_ids))
        logprobs.append(completion.logprobs)
    width = max(len(r) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.bool)
    prompt_mask = torch.zeros((n, width), dtype=torch.bool)
    target_mask = torch.zeros((n, width - 1), dtype=torch.bool)
    gen_logprobs = torch.zeros((n, width - 1), dtype=torch.float32)
    for i, (row, start, lps) in enumerate(zip(rows, starts, logprobs)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = True
        prompt_mask[i, :start] = True
        # target index t is token t+1: generated tokens start..len-1 are targets start-1..len-2
        target_mask[i, start - 1 : len(row) - 1] = True
        if completions[i].loss_mask is not None:  # environment tokens: context, never trained
            target_mask[i, start - 1 : len(row) - 1] = torch.tensor(completions[i].loss_mask) > 0
        gen_logprobs[i, start - 1 : len(row) - 1] = torch.tensor(lps, dtype=torch.float32)
    return TrainBatch(
        input_ids,
        attention,
        prompt_mask,
        target_mask,
        gen_logprobs,
        torch.tensor(advantages, dtype=torch.float32),
        [p.media for p in prompts],
        _routing(completions, width),
    )


def _routing(completions: list[Completion], width: int) -> torch.Tensor | None:
    """The completions' recorded experts as one [N, width, layers, k] tensor (-1: none)."""
    if not completions or any(c.routing is None for c in completions):
        return None
    first = completions[0].routing
    out = torch.full((len(completions), width, *first.shape[1:]), -1, dtype=first.dtype)
    for i, c in enumerate(completions):
        out[i, : c.routing.shape[0]] = c.routing
    return out
