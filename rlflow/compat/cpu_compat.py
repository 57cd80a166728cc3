"""The one place that makes megatron-core 0.19.2 run without a GPU (CPU CI, laptops).

megatron-core hard-codes CUDA in a handful of spots that the local (non-Transformer-Engine)
model path reaches. `enable()` patches exactly those, and only when no GPU is present; on a
GPU machine it does nothing. Each patch names the megatron-core code it replaces:

1. `torch.cuda.current_device()` is used as a device by the RoPE `inv_freq` buffer
   (rotary_pos_embedding.py), the global memory buffer (utils.GlobalMemoryBuffer) and DDP's
   grad buffers. It returns "cpu" here.
2. The default causal mask (transformer/utils.get_default_causal_mask, also imported by
   fusions/fused_softmax.py) allocates with device="cuda". Replaced by a CPU mask.
3. Gradient clipping (optimizer/clip_grads.py: get_grad_norm_fp32, clip_grad_by_total_norm_fp32)
   asserts CUDA tensors and allocates on "cuda". Replaced by device-agnostic versions with the
   same all-reduce semantics, bound where optimizer.py imported them. The optimizer classes
   (optimizer/optimizer.py) allocate scale and overflow flags with device='cuda': that module
   alone sees a `torch` whose tensor factories map "cuda" to "cpu".
4. The model-parallel RNG tracker forks CUDA RNG states (tensor_parallel/random.py). rlflow
   trains with dropout 0, so `seed_model_parallel_rng` uses megatron's inference tracker,
   whose fork() is a no-op, instead of model_parallel_cuda_manual_seed.
5. `torch.cuda.synchronize`, `torch.cuda.Event`, `torch.cuda.empty_cache` and the stream API
   (`current_stream`, `Stream`, `stream`: DDP's gradient reduction waits on streams,
   distributed/param_and_grad_buffer.py) become no-ops, so code written for GPUs runs unchanged.
   That module's `torch.zeros(..., device="cuda")` warm-up buffer gets the same CPU factories
   as the optimizer (point 3).

6. The MoE all-to-all dispatcher (transformer/moe/token_dispatcher.py) turns its split sizes
   into numpy arrays only when they live on a GPU (moe_utils.maybe_move_tensor_to_cpu); CPU
   tensors reach `all_to_all_single`, whose binding takes sequences. Bound there: CPU tensors
   asked for as numpy become numpy too.
7. Under expert parallelism combined with expert-tensor parallelism (TP x EP), that dispatcher
   all-gathers each TP rank's received tokens and reduce-scatters their outputs with unequal
   counts per rank (tensor_parallel/mappings.py: `_gather_along_first_dim` with
   `output_split_sizes`, `_reduce_scatter_along_first_dim` with `input_split_sizes`, through
   the list forms of `all_gather`/`reduce_scatter`). NCCL takes unequal sizes; gloo refuses them
   (pytorch/pytorch#156627). On gloo groups both run as the equal-size collectives over chunks
   padded with zeros to the largest count (every rank knows the counts: no extra collective),
   then the padding is cut off. The sums are the same: only zeros are added.
8. megatron-core's Mamba mixer (ssm/mamba_mixer.py) takes its training and prefill kernels from
   the `mamba-ssm` and `causal-conv1d` CUDA packages, and without them refuses to build
   (`HAVE_MAMBA_SSM`) and subclasses a MagicMock for its gated norm. Bound there: the plain
   PyTorch kernels of rlflow/compat/mamba_reference.py (`mamba_split_conv1d_scan_combined`,
   `mamba_chunk_scan_combined`, `causal_conv1d_fn`, a gated `RMSNorm` with the mixer's sharded
   state dict), and the sequence-packing version check answers yes (the reference takes
   `seq_idx`). `install_mamba_reference()` is the same patch on a GPU without causal-conv1d.

rlflow's own generation engine does not use megatron-core's inference controller, so its
CUDA-only paths (text_generation_controller.py) need no patch.
"""

from __future__ import annotations

import contextlib
import types

import torch

_enabled = False


def needs_compat() -> bool:
    return not torch.cuda.is_available()


def enable() -> bool:
    """Apply the patches once if there is no GPU; return whether they are active."""
    global _enabled
    if _enabled or not needs_compat():
        return _enabled
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None
    torch.cuda.Event = _NoOpEvent
    torch.cuda.Stream = _NoOpStream
    torch.cuda.current_stream = lambda *args, **kwargs: _NoOpStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    _patch_causal_mask()
    _patch_grad_clipping()
    _patch_optimizer_allocations()
    _patch_moe_split_sizes()
    _patch_uneven_collectives()
    install_mamba_reference()
    _enabled = True
    return True


def seed_model_parallel_rng(seed: int) -> None:
    """megatron's model-parallel RNG setup: CUDA states on a GPU, a no-op tracker on CPU."""
    from megatron.core.tensor_parallel import random as mp_random

    if needs_compat():
        mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        mp_random.model_parallel_cuda_manual_seed(seed)


class _NoOpEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NoOpStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpEvent()


def _patch_causal_mask() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


class _TorchWithCpuFactories(types.ModuleType):
    """`torch` as seen by one megatron module: factories given device='cuda' allocate on CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name not in self._FACTORIES:
            return value

        def factory(*args, device=None, **kwargs):
            if device is not None and str(device).startswith("cuda"):
                device = "cpu"
            return value(*args, device=device, **kwargs)

        return factory


def _patch_optimizer_allocations() -> None:
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import optimizer

    optimizer.torch = _TorchWithCpuFactories("torch")
    param_and_grad_buffer.torch = _TorchWithCpuFactories("torch")


def _patch_grad_clipping() -> None:
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.utils import to_local_if_dtensor

    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        if isinstance(grads_for_norm, torch.Tensor):
            grads_for_norm = [grads_for_norm]
        grads = [to_local_if_dtensor(g).float() for g in grads_for_norm]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            total = torch.tensor([max((g.abs().max().item() for g in grads), default=0.0)])
            torch.distributed.all_reduce(
                total, op=torch.distributed.ReduceOp.MAX, group=grad_stats_parallel_group
            )
            return total.item()
        total = torch.zeros(1)
        for g in grads:
            total += torch.norm(g, norm_type) ** norm_type
        torch.distributed.all_reduce(
            total, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group
        )
        return total.item() ** (1.0 / norm_type)

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        coeff = max_norm / (float(total_norm) + 1.0e-6)
        if coeff < 1.0:
            for p in parameters:
                grad = getattr(p, attr, None)
                if grad is not None:
                    to_local_if_dtensor(grad).detach().mul_(coeff)

    for module in (clip_grads, optimizer):
        module.get_grad_norm_fp32 = get_grad_norm_fp32
        module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _patch_moe_split_sizes() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_uneven_collectives() -> None:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = (
        mappings._gather_along_first_dim,
        mappings._reduce_scatter_along_first_dim,
    )

    def on_gloo(group, sizes) -> bool:
        return sizes is not None and group.size() > 1 and dist.get_backend(group) == "gloo"

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if not on_gloo(group, output_split_sizes):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes, width = list(output_split_sizes), max(output_split_sizes)
        if width == 0:  # (gloo divides by the element count)
            return input_.new_empty((0, *input_.shape[1:]))
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((width * len(sizes), *input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[i * width : i * width + n] for i, n in enumerate(sizes)])

    def _reduce_scatter_along_first_dim(
        input_, group, input_split_sizes=None, use_global_buffer=False
    ):
        if not on_gloo(group, input_split_sizes):
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes, width = list(input_split_sizes), max(input_split_sizes)
        mine = sizes[group.rank()]
        if width == 0:
            return input_.new_empty((0, *input_.shape[1:]))
        padded = input_.new_zeros((width * len(sizes), *input_.shape[1:]))
        for i, chunk in enumerate(torch.split(input_, sizes, dim=0)):
            padded[i * width : i * width + chunk.shape[0]] = chunk
        out = input_.new_empty((width, *input_.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=group)
        return out[:mine].clone()

    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


def install_mamba_reference() -> bool:
    """Patch 8: megatron-core's Mamba mixer on rlflow's kernels; a no-op (False) where mamba-ssm
    and causal-conv1d are both installed (the mixer's own fused CUDA path runs). mamba-ssm alone
    (its Triton-only build) serves the update's scan from inside rlflow's kernels."""
    import importlib.util

    from megatron.core.ssm import mamba_mixer

    if getattr(mamba_mixer, "_rlflow_reference", False):
        return True
    if all(importlib.util.find_spec(m) is not None for m in ("mamba_ssm", "causal_conv1d")):
        return False
    from rlflow.compat import mamba_reference as ref

    class ExtendedRMSNorm(ref.RMSNormGated):  # megatron's subclasses a MagicMock here
        sharded_state_dict = _norm_sharded_state_dict

    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.RMSNormGated = ref.RMSNormGated
    mamba_mixer.ExtendedRMSNorm = ExtendedRMSNorm
    mamba_mixer.causal_conv1d_fn = ref.causal_conv1d_fn
    mamba_mixer.mamba_chunk_scan_combined = ref.mamba_chunk_scan_combined
    mamba_mixer.mamba_split_conv1d_scan_combined = ref.mamba_split_conv1d_scan_combined
    mamba_mixer._check_mamba_sequence_packing_support = lambda **_: (True, None)
    mamba_mixer._rlflow_reference = True
    return True


def _norm_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """megatron-core's ExtendedRMSNorm.sharded_state_dict: the weight split along axis 0."""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    return make_sharded_tensors_for_checkpoint(
        self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
        tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"],
    )  # fmt: skip
