"""Sequence parallelism (`parallelism.sequence_parallel`) in rlflow's own forward passes.

With tensor parallelism alone every rank holds the whole sequence's activations between the
attention and MLP blocks, and each block ends in an all-reduce. Sequence parallelism
(megatron-core's `TransformerConfig.sequence_parallel`) splits the sequence over the
tensor-parallel ranks there instead: the all-reduce becomes a reduce-scatter plus an all-gather
(the same bytes) and the norms, residual adds and their activations shrink by the TP size.

megatron-core does the layers; rlflow's forwards place vision features into the embeddings and
pick target positions out of the last hidden states, which need the whole sequence, so:

* `install` stops the embedding from scattering its output (rlflow places the features first,
  then `scatter` splits the result; DeepStack's additions are split the same way);
* the sequence must be a multiple of the TP size: `pad_columns` pads a padded batch with masked
  columns, the packed forward adds a short dummy row (`pad_length`);
* `gather` gives the packed output processor the whole last hidden state back.

Without sequence parallelism every function here is the identity.
"""

from __future__ import annotations

import torch


def enabled(core) -> bool:
    return bool(getattr(core.config, "sequence_parallel", False))


def install(language_model) -> None:
    """The embedding returns the whole sequence; rlflow's forwards scatter it (`scatter`)."""
    embedding = getattr(language_model, "embedding", None)
    if embedding is None or not enabled(language_model):
        return
    embedding.scatter_to_sequence_parallel = False
    embedding.reduce_scatter_embeddings = False
    embedding.word_embeddings.reduce_scatter_embeddings = False


def pad_length(core, length: int) -> int:
    """Tokens to add so `length` divides evenly over the tensor-parallel ranks (0 without SP)."""
    if not enabled(core):
        return 0
    return -length % core.config.tensor_model_parallel_size


def pad_columns(core, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[B, L] tensors padded on the right with zeros (False / token 0) to a multiple of TP."""
    extra = pad_length(core, tensors[0].shape[1])
    if not extra:
        return tensors
    return tuple(torch.nn.functional.pad(t, (0, extra)) for t in tensors)


def scatter(core, hidden: torch.Tensor) -> torch.Tensor:
    """[T, B, H] -> this rank's [T/tp, B, H] (gradients are gathered back in the backward)."""
    if not enabled(core):
        return hidden
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    return scatter_to_sequence_parallel_region(hidden)


def gather(core, hidden: torch.Tensor) -> torch.Tensor:
    """This rank's [T/tp, B, H] -> [T, B, H]. The backward keeps this rank's slice only: the
    caller's tensor-parallel layer (the output layer's input copy) sums the gradient first."""
    if not enabled(core):
        return hidden
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)


def scatter_deepstack(core, deepstack, shape: torch.Size):
    """DeepStack's additions for this rank's slice of hidden states [T, B, H] (`shape`): each
    layer's features laid out over the whole sequence, then split like the hidden states."""
    if deepstack is None or not enabled(core):
        return deepstack
    from rlflow.model.families.qwen3vl.deepstack import DeepStack

    _, batch, width = shape
    local = [
        scatter(core, layer.new_zeros(shape).index_put(deepstack.index, layer, accumulate=True))
        for layer in deepstack.layers
    ]
    local = [part.reshape(-1, width) for part in local]
    rows = local[0].shape[0] // batch
    device = local[0].device
    index = (
        torch.arange(rows, device=device).repeat_interleave(batch),
        torch.arange(batch, device=device).repeat(rows),
    )
    return DeepStack(index, local)


def allow_torch_norms() -> None:
    """Let megatron-core's torch norms (the local spec's norms without apex) run split.

    `WrappedTorchNorm` refuses `sequence_parallel` although an RMSNorm or LayerNorm works per
    token: what sequence parallelism needs is that the norm's weight gradients, computed on
    each rank's slice of the sequence, are summed over the tensor-parallel ranks. megatron-core
    does that (finalize_model_grads) for parameters marked `sequence_parallel`, as its own
    fused norm marks them; this builds the torch norm and marks its parameters the same way.
    """
    import copy

    from megatron.core.transformer import torch_norm

    norm_class = torch_norm.WrappedTorchNorm
    if getattr(norm_class, "_rlflow_sequence_parallel", False):
        return
    original = norm_class.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        unsplit = copy.copy(config)
        unsplit.sequence_parallel = False
        norm = original(cls, unsplit, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    norm_class.__new__ = staticmethod(__new__)
    norm_class._rlflow_sequence_parallel = True
