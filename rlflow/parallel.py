"""The only module that knows about ranks, process groups and devices.

`rlflow train` runs one process per GPU (or per requested rank on CPU-only nodes). The launcher
(`python -m rlflow.job.node`, or torchrun) provides RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; run directly with none of them, this is a single rank.
`init_parallel` sets up torch.distributed and megatron-core's tensor/pipeline/context/expert
parallel groups; everything else asks this module for ranks and groups.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlflow.recipe.schema import ParallelismConfig


@dataclass(frozen=True)
class ParallelInfo:
    rank: int
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_info: ParallelInfo | None = None


def init_parallel(cfg: ParallelismConfig, seed: int, *, timeout_s: int) -> ParallelInfo:
    """torch.distributed + megatron-core parallel state from the launcher's environment;
    `timeout_s` is one collective's limit (the recipe's watchdog.collective_timeout_s)."""
    global _info
    from megatron.core import parallel_state

    from rlflow.model.compat import cpu_compat

    cpu_compat.enable()
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # A launcher sets WORLD_SIZE and the rendezvous; a lone process picks its own free port and
    # leaves os.environ alone, so processes it starts never inherit a port it holds.
    init_method = "env://" if "WORLD_SIZE" in os.environ else f"tcp://127.0.0.1:{_free_port()}"
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_parallel_size,
    )
    cpu_compat.seed_model_parallel_rng(seed)
    _info = ParallelInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        device=device,
    )
    return _info


def sequence_parallel(cfg: ParallelismConfig) -> bool:
    """Whether the trainer splits activations over the TP ranks (`parallelism.sequence_parallel`;
    the recipe rules refuse "on" at TP=1)."""
    if cfg.sequence_parallel == "auto":
        return cfg.tensor_parallel_size > 1
    return cfg.sequence_parallel == "on"


def info() -> ParallelInfo:
    assert _info is not None, "init_parallel() has not run"
    return _info


def data_parallel_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def tensor_parallel_group():
    """The tensor-parallel group of this rank, or None when the model is not split (TP=1)."""
    from megatron.core import parallel_state

    if info().tp_size == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Sum a few floats over ranks (metrics, token counts); one collective for the whole list."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, group=group)
    return t.tolist()


def all_reduce_max(value: float, group=None) -> float:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from global rank `src` to every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=_comm_device())
    return box[0]


def all_gather_objects(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _comm_device() -> torch.device:
    return info().device if _info is not None else torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
