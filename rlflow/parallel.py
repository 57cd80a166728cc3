"""The only module that knows about ranks, process groups and devices.

`rlflow train` runs one process per GPU (or per requested rank on CPU-only nodes). The launcher
(`python -m rlflow.job.node`, or torchrun) provides RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; run directly with none of them, this is a single rank.
`init_parallel` sets up torch.distributed and megatron-core's tensor/pipeline/context/expert
parallel groups; everything else asks this module for ranks and groups.

With `generation.placement: separate` the job's ranks split into two roles
(rlflow.rules.allocation.Placement): training ranks and generation ranks. Each role is a
torch.distributed world of its own, with megatron-core's groups inside it (the generation ranks
with their own tensor-parallel size), so every collective of the trainer runs among trainers
only. Groups that span both roles are separate process groups on the launcher's rendezvous
store (`cross_group`): gloo for messages, NCCL (gloo on CPU) for the weight broadcasts.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlflow.recipe.placement import Placement, Role, splits_sequence
from rlflow.recipe.schema import ParallelismConfig


@dataclass(frozen=True)
class ParallelInfo:
    rank: int  # in this rank's torch.distributed world (its role's, with separate placement)
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    device: torch.device
    job_rank: int = 0  # the launcher's RANK: the log file, fault injection, rank 0 of the job
    role: Role = "train"
    cp_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.job_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_info: ParallelInfo | None = None
# The backend of device cross groups on GPUs: "nccl", or "gloo" to stage through host memory
# (benchmarks: two processes on one GPU, which NCCL refuses).
CROSS_DEVICE_BACKEND = "nccl"
_job: _Job | None = None  # separate placement: the job-wide store and the role layout


@dataclass
class _Job:
    store: dist.Store
    placement: Placement
    timeout: datetime.timedelta
    groups: int = 0  # cross groups made so far (each gets its own store prefix)


def init_parallel(
    cfg: ParallelismConfig, seed: int, *, timeout_s: int, placement: Placement | None
) -> ParallelInfo:
    """torch.distributed + megatron-core parallel state from the launcher's environment;
    `timeout_s` is one collective's limit (the recipe's watchdog.collective_timeout_s).

    With a separate placement, `cfg` is this rank's role's parallel sizes, and the world that
    torch.distributed and megatron-core see is the role's ranks only."""
    global _info, _job
    from megatron.core import parallel_state

    from rlflow.compat import cpu_compat

    cpu_compat.enable()
    job_rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=timeout_s)
    device, backend = _device()
    rank, role = job_rank, "train"
    if placement is not None and placement.separate and not dist.is_initialized():
        role = placement.role(job_rank)
        members = placement.ranks(role)
        rank, world_size = members.index(job_rank), len(members)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            int(os.environ["WORLD_SIZE"]),
            is_master=job_rank == 0,
            timeout=timeout,
        )
        _job = _Job(store, placement, timeout)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"rlflow/{role}/", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    elif not dist.is_initialized():
        # A launcher sets WORLD_SIZE and the rendezvous; a lone process picks its own free port
        # and leaves os.environ alone, so processes it starts never inherit a port it holds.
        init_method = "env://" if "WORLD_SIZE" in os.environ else f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
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
        job_rank=job_rank,
        role=role,
        cp_rank=parallel_state.get_context_parallel_rank(),
    )
    if _job is not None:
        job_group()  # now, while every rank is here: it connects all of them
    return _info


def _device() -> tuple[torch.device, str]:
    """This rank's device and its collective backend (nccl on GPUs, gloo on CPU)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def sequence_parallel(cfg: ParallelismConfig) -> bool:
    """Whether the trainer splits activations over the TP ranks (the recipe rule's answer)."""
    return splits_sequence(cfg)


def info() -> ParallelInfo:
    assert _info is not None, "init_parallel() has not run"
    return _info


def data_parallel_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def expert_parallel_size() -> int:
    """megatron-core's expert-model-parallel size (1 before init_parallel, or without experts)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_expert_model_parallel_world_size()


def tensor_parallel_group():
    """The tensor-parallel group of this rank, or None when the model is not split (TP=1)."""
    from megatron.core import parallel_state

    if info().tp_size == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def all_reduce_tensor(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum a tensor over ranks, in place (integer checksums, partial sums of shards)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


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


# ---------------------------------------------------------------- across the two roles


def placement() -> Placement | None:
    """The job's roles, when generation has ranks of its own (None: colocated)."""
    return None if _job is None else _job.placement


def peers() -> list[dict]:
    """Every job rank's role and parallel coordinates, indexed by job rank (one all-gather over
    the whole job): what the weight sync needs to pair trainer shards with generation ranks."""
    me = info()
    mine = {
        "role": me.role,
        "tp_rank": me.tp_rank,
        "tp_size": me.tp_size,
        "dp_rank": me.dp_rank,
        "cp_rank": me.cp_rank,
        **_expert_coordinates(),
    }
    everyone = job_group()
    return everyone.all_gather_object(mine)


def _expert_coordinates() -> dict:
    """This rank's expert-parallel rank, expert-tensor-parallel rank and expert-data-parallel
    rank (megatron-core's expert groups; all 0 without expert parallelism)."""
    from megatron.core import parallel_state

    return {
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "etp_rank": parallel_state.get_expert_tensor_parallel_rank(),
        "edp_rank": parallel_state.get_expert_data_parallel_rank(),
    }


_job_group: CrossGroup | None = None


def job_group() -> CrossGroup:
    """All ranks of the job, both roles (gloo): small messages between trainers and generators."""
    global _job_group
    if _job_group is None:
        assert _job is not None, "job_group() needs a separate placement"
        _job_group = cross_group(tuple(range(int(os.environ["WORLD_SIZE"]))), device=False)
    return _job_group


def cross_group(ranks: tuple[int, ...], *, device: bool) -> CrossGroup | None:
    """A process group over job ranks of both roles; None on a rank outside it.

    Every rank of the job must call this for every group, in the same order (each group takes
    the next store prefix); only members connect. device=True: NCCL on GPUs (the weight
    broadcasts), gloo on CPU; device=False: gloo, for pickled messages."""
    assert _job is not None, "cross groups need a separate placement"
    _job.groups += 1
    me = info().job_rank
    if me not in ranks:
        return None
    store = dist.PrefixStore(f"rlflow/cross/{_job.groups}/", _job.store)
    if device and info().device.type == "cuda" and CROSS_DEVICE_BACKEND == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _job.timeout
        pg = dist.ProcessGroupNCCL(store, ranks.index(me), len(ranks), options)
        return CrossGroup(pg, ranks, info().device)
    pg = dist.ProcessGroupGloo(store, ranks.index(me), len(ranks), _job.timeout)
    return CrossGroup(pg, ranks, torch.device("cpu"))


class CrossGroup:
    """Collectives over a cross-role group, addressed by job rank.

    `keep_alive`, where a call takes it, runs every KEEP_ALIVE_SECONDS while this rank waits for
    the others (a rank waiting on a peer is not hung: the watchdog judges the peer by its own
    progress reports)."""

    KEEP_ALIVE_SECONDS = 2.0

    def __init__(self, pg, ranks: tuple[int, ...], device: torch.device):
        self.pg, self.ranks, self.device = pg, ranks, device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """`tensor` from job rank `src` to every member, in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self.ranks.index(src)
        self.pg.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj, src: int, keep_alive: Callable[[], None] | None = None):
        """A picklable object from job rank `src` to every member (gloo groups)."""

        def transfer():
            mine = info().job_rank == src
            data = pickle.dumps(obj) if mine else b""
            size = torch.tensor([len(data)], dtype=torch.int64)
            self.broadcast(size, src)
            buffer = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if mine
                else torch.empty(int(size), dtype=torch.uint8)
            )
            if int(size):
                self.broadcast(buffer, src)
            return obj if mine else pickle.loads(buffer.numpy().tobytes())

        return _waiting(transfer, keep_alive)

    def all_gather_object(self, obj, keep_alive: Callable[[], None] | None = None) -> list:
        """Every member's object, in member order (gloo groups)."""

        def transfer():
            data = pickle.dumps(obj)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in self.ranks]
            self.pg.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
            width = max(int(s) for s in sizes)
            mine = torch.zeros(width, dtype=torch.uint8)
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            out = [torch.zeros(width, dtype=torch.uint8) for _ in self.ranks]
            self.pg.allgather([out], [mine]).wait()
            return [pickle.loads(t[: int(n)].numpy().tobytes()) for t, n in zip(out, sizes)]

        return _waiting(transfer, keep_alive)


def _waiting(transfer: Callable, keep_alive: Callable[[], None] | None):
    """Run `transfer`; with `keep_alive`, in a thread while this one reports progress."""
    if keep_alive is None:
        return transfer()
    box: dict = {}

    def run():
        try:
            box["value"] = transfer()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = err

    thread = threading.Thread(target=run, name="rlflow-cross-wait", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(CrossGroup.KEEP_ALIVE_SECONDS)
        if thread.is_alive():
            keep_alive()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _comm_device() -> torch.device:
    return info().device if _info is not None else torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
