"""Vision features in the language model: written at the pad tokens, and (DeepStack) added to
the hidden states of the first decoder layers.

A vision tower row (`ModelFamily.vision_features`) is [H * (1 + k)]: the embedding that replaces
the pad token's, then k rows that Qwen3-VL's DeepStack adds to the output of decoder layers
0..k-1 at the same positions (HF: `Qwen3VLTextModel._deepstack_process`). Families without
DeepStack have k = 0, and nothing here changes their forward. Keeping both parts in one row lets
the vision cache, the placement and the packing treat every family alike.

The language model is megatron-core's, which knows nothing of this: `install` puts a forward
hook on the first layers that adds the features of the forward running inside `adding(...)`.
The generation decoder (rlflow/generation/megatron/decoder.py) adds them itself, with `DeepStack.add`.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch


@dataclass
class DeepStack:
    """Features added after the first decoder layers, at the visual positions `index`."""

    index: tuple[torch.Tensor, ...]  # advanced index of the visual positions in the hidden states
    layers: list[torch.Tensor]  # [n, H] per layer: added to the output of decoder layer i

    def add(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """hidden + this layer's features at the visual positions (unchanged past the last)."""
        if layer >= len(self.layers):
            return hidden
        return hidden.index_put(self.index, self.layers[layer].to(hidden.dtype), accumulate=True)

    def packed(self, valid: torch.Tensor) -> DeepStack:
        """For hidden states [T, B, H] cut to the real tokens of rows valid [B, T], row after row
        ([N, H]): the same features, addressed by packed position."""
        packed_of = torch.full(valid.shape, -1, dtype=torch.long, device=valid.device)
        packed_of[valid] = torch.arange(int(valid.sum()), device=valid.device)
        t, b = self.index
        return DeepStack((packed_of[b, t],), self.layers)


@dataclass
class Embedded:
    """The language model's input: embeddings [T, B, H] and, for DeepStack families, the rest."""

    hidden: torch.Tensor
    deepstack: DeepStack | None = None


def place(embeddings: torch.Tensor, slots: list[torch.Tensor], features) -> Embedded:
    """embeddings [T, B, H] with each kind's feature rows at its slots [B, T] (image, video)."""
    width = embeddings.shape[-1]
    batch_major = embeddings.transpose(0, 1)  # [B, T, H]: the order rows fill the slots in
    index_t, index_b, extra = [], [], []
    for feats, where in zip(features, slots):
        if feats is None:
            continue
        if int(where.sum()) != feats.shape[0]:
            raise ValueError(
                f"prompt holds {int(where.sum())} media pad tokens but the media give "
                f"{feats.shape[0]} embeddings"
            )
        main = feats[:, :width].to(batch_major.dtype)
        batch_major = batch_major.masked_scatter(where.unsqueeze(-1), main)
        if feats.shape[-1] > width:
            b, t = where.nonzero(as_tuple=True)
            index_t.append(t)
            index_b.append(b)
            extra.append(feats[:, width:])
    hidden = batch_major.transpose(0, 1).contiguous()
    if not extra:
        return Embedded(hidden)
    layers = list(torch.cat(extra).split(width, dim=-1))
    return Embedded(hidden, DeepStack((torch.cat(index_t), torch.cat(index_b)), layers))


_CURRENT: contextvars.ContextVar[DeepStack | None] = contextvars.ContextVar(
    "deepstack", default=None
)


@contextlib.contextmanager
def adding(deepstack: DeepStack | None):
    """Within this block, the installed hooks add `deepstack` (None: nothing) to the hidden states."""
    token = _CURRENT.set(deepstack)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def install(language_model, num_layers: int) -> None:
    """Hooks on decoder layers 0..num_layers-1 (global numbering) that add the current features."""
    for layer in language_model.decoder.layers:
        index = layer.layer_number - 1
        if index >= num_layers or getattr(layer, "_rlflow_deepstack", False):
            continue
        layer.register_forward_hook(_hook(index))
        layer._rlflow_deepstack = True


def _hook(index: int):
    def hook(module, args, output):
        deepstack = _CURRENT.get()
        if deepstack is None:
            return output
        hidden, *rest = output
        return (deepstack.add(hidden, index), *rest)

    return hook
