"""Weight sync, trainer -> generation ranks (`generation.placement: separate`).

The trainer's weights reach every generation rank by collective broadcasts in buckets (NCCL on
GPUs, gloo on CPU), shard to shard:

- senders: the trainers of data-parallel replica 0 (and context-parallel rank 0), one per
  training tensor-parallel rank i. Each broadcasts its own shard i of every weight; nobody
  gathers the model, nothing touches the filesystem;
- groups: one per training shard i, over sender i and the generation ranks whose shard shares
  rows with shard i (every generation replica), plus one from sender 0 to all generation ranks
  for the weights every rank holds whole (norms, row-parallel biases);
- routed experts under expert parallelism: one group per (EP rank, expert-tensor-parallel shard)
  from the trainer of expert-data-parallel replica 0 that holds those experts; the generation
  ranks hold every expert (EP 1), so both sides name experts by global index
  (`global_parameters`);
- reshard: a receiver copies the rows of shard i that fall into its own shard
  (rlflow.train.generation_role.reshard.copy_overlap), so the two sides' tensor-parallel sizes may differ;
- buckets: consecutive weights up to `generation.sync_bucket_mb`, one broadcast per group and
  bucket, in one order that every rank follows (so no two groups can wait on each other).

After each sync both sides compute a fingerprint of every synced tensor from their own shards
(reshard.partial_checksum: integer checksums of sampled elements, summed over the shards of a
tensor-parallel group) and job rank 0 compares them for every generation rank: torn or stale
weights stop the run, naming the rank, the version and the tensors.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

import torch

from rlflow import parallel
from rlflow.errors import Diagnostic, RlflowError
from rlflow.train import faults
from rlflow.train.generation_role.reshard import (
    Layout,
    copy_overlap,
    layout_of,
    overlaps,
    partial_checksum,
    sample_positions,
)

WHOLE = -1  # the group key of weights every rank holds whole


# A group key: WHOLE, a training tensor-parallel shard i (int), or a routed expert shard
# (ep, i): expert-parallel rank ep's experts, expert-tensor-parallel shard i
Key = int | tuple[int, int]


@dataclass(frozen=True)
class Route:
    """Who sends which shard to whom, from every job rank's parallel coordinates."""

    senders: tuple[int, ...]  # job rank of training shard i (replica 0), by i
    receivers: dict[int, int]  # generation job rank -> its tensor-parallel rank
    train_tp: int
    gen_tp: int
    # (ep, i) -> job rank holding that EP rank's experts, shard i (expert-data-parallel rank 0)
    experts: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(peers: list[dict]) -> Route:
        train = [(r, p) for r, p in enumerate(peers) if p["role"] == "train" and p["cp_rank"] == 0]
        senders = sorted((p["tp_rank"], r) for r, p in train if p["dp_rank"] == 0)
        experts = {(p["ep_rank"], p["etp_rank"]): r for r, p in train if p["edp_rank"] == 0}
        receivers = {r: p["tp_rank"] for r, p in enumerate(peers) if p["role"] == "generate"}
        gen_tp = next(p["tp_size"] for p in peers if p["role"] == "generate")
        return Route(tuple(r for _, r in senders), receivers, len(senders), gen_tp, experts)

    @property
    def expert_ranks(self) -> int:
        return 1 + max((ep for ep, _ in self.experts), default=0)

    @property
    def all_senders(self) -> tuple[int, ...]:
        """Every trainer that sends something (its shards of the dense or the expert weights)."""
        return tuple(sorted({*self.senders, *self.experts.values()}))

    def members(self, key: Key) -> tuple[int, ...]:
        """Job ranks of the group that carries training shard `key` (WHOLE: whole tensors)."""
        if key == WHOLE:
            return (self.senders[0], *sorted(self.receivers))
        shard = key[1] if isinstance(key, tuple) else key
        wanted = set(overlaps(shard, self.train_tp, self.gen_tp))
        gen = sorted(r for r, tp in self.receivers.items() if tp in wanted)
        return (self.source(key), *gen)

    def source(self, key: Key) -> int:
        if isinstance(key, tuple):
            return self.experts[key]
        return self.senders[0 if key == WHOLE else key]


# a routed expert's weight: megatron-core's SequentialMLP names its experts by local index
_LOCAL_EXPERT = re.compile(r"^(.*\.experts)\.local_experts\.(\d+)\.(.*)$")


def _expert_parts(name: str, param) -> tuple[str, int, str] | None:
    """(the experts module, local index, the rest) of a routed expert's weight, else None."""
    match = _LOCAL_EXPERT.match(name)
    if match is None or getattr(param, "allreduce", True):  # allreduce False: an expert weight
        return None
    return match.group(1), int(match.group(2)), match.group(3)


def global_parameters(policy) -> dict[str, tuple[torch.nn.Parameter, int]]:
    """Every parameter of this rank under its name on a rank without expert parallelism: a
    routed expert's local index becomes its global one (EP rank x local experts + index);
    -> (the parameter, the EP rank that holds it or -1 for a weight that is not an expert's)."""
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_rank()
    modules = dict(policy.core.named_modules())
    out = {}
    for name, param in policy.core.named_parameters():
        parts = _expert_parts(name, param)
        if parts is None:
            out[name] = (param, -1)
            continue
        module, index, rest = parts
        local = modules[module].num_local_experts
        out[f"{module}.local_experts.{ep * local + index}.{rest}"] = (param, ep)
    return out


def synced_layouts(policy, tp: int) -> list[Layout]:
    """The trainer's weights a sync carries: every trainable parameter, in module order (a frozen
    vision tower is the same on both sides: both load the same checkpoint). With expert
    parallelism, job rank 0 (EP rank 0) lists every EP rank's experts where it lists its own:
    all hold experts of the same shapes, named by global index (`global_parameters`)."""
    from rlflow import parallel as par

    ranks = par.expert_parallel_size()
    modules = dict(policy.core.named_modules())
    out = []
    for name, param in policy.core.named_parameters():
        if not param.requires_grad:
            continue
        parts = _expert_parts(name, param)
        if parts is None:
            out.append(layout_of(name, param, tp))
            continue
        module, index, rest = parts
        local = modules[module].num_local_experts
        mine = layout_of(name, param, tp)
        if mine.dim is None:
            raise RlflowError(
                Diagnostic(
                    "async.weight-layout",
                    f"{name}: a routed expert's weight that is not split over tensor-parallel "
                    "ranks; the weight sync of expert-parallel shards does not carry it",
                    help="set parallelism.expert_parallel_size 1 with generation.placement "
                    "separate",
                )
            )
        for ep in range(ranks):
            global_name = f"{module}.local_experts.{ep * local + index}.{rest}"
            out.append(dataclasses.replace(mine, name=global_name, expert=ep))
    return out


def buckets(layouts: list[Layout], bucket_bytes: int) -> list[list[int]]:
    """Consecutive weights of one dtype, at most bucket_bytes of whole tensors each (a larger
    tensor goes alone)."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, layout in enumerate(layouts):
        nbytes = layout.numel * torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
        if not out or layout.dtype != dtype or size + nbytes > bucket_bytes:
            out.append([])
            size, dtype = 0, layout.dtype
        out[-1].append(i)
        size += nbytes
    return out


class WeightSync:
    """One side of the sync; trainer and generation ranks build it with the same plan."""

    def __init__(self, policy, layouts: list[Layout], bucket_mb: int):
        me = parallel.info()
        self.policy, self.layouts, self.me = policy, layouts, me.job_rank
        self.route = Route.of(parallel.peers())
        self.tp_rank, self.tp = me.tp_rank, me.tp_size
        self.buckets = buckets(layouts, bucket_mb * 2**20)
        self.keys: list[Key] = [WHOLE, *range(self.route.train_tp), *sorted(self.route.experts)]
        self.groups: dict[Key, parallel.CrossGroup | None] = {}
        made: dict[tuple[int, ...], parallel.CrossGroup | None] = {}
        for key in self.keys:  # every rank, the same order: each group its own store prefix
            members = self.route.members(key)
            if members not in made:
                made[members] = parallel.cross_group(members, device=True)
            self.groups[key] = made[members]
        # the trainers' fingerprints are summed over every sender (their shards of the dense
        # weights and of each EP rank's experts); a generation replica sums over its TP group
        senders = self.route.all_senders
        self.senders_group = (
            parallel.cross_group(senders, device=False) if len(senders) > 1 else None
        )
        params = global_parameters(policy)
        self.params = [params.get(layout.name, (None, -1))[0] for layout in layouts]
        self.me_ep = {ep for (ep, tp), r in self.route.experts.items() if r == self.me}
        self.version = -1

    @property
    def sends(self) -> bool:
        return self.me in self.route.all_senders

    def _pieces(self, bucket: list[int], key: Key) -> list[int]:
        if isinstance(key, tuple):
            return [i for i in bucket if self.layouts[i].expert == key[0]]
        whole = key == WHOLE
        return [
            i for i in bucket
            if self.layouts[i].expert < 0 and (self.layouts[i].dim is None) == whole
        ]  # fmt: skip

    @torch.no_grad()
    def run(self, version: int) -> float:
        """Send (trainer) or receive (generation rank) the weights of `version`; seconds spent."""
        start = time.perf_counter()
        faults.inject_failure(self.me, f"sync{version}")
        receives = self.me in self.route.receivers
        torn = receives and faults.torn(self.me, f"sync{version}")
        for b, bucket in enumerate(self.buckets):
            for key in self.keys:
                group, pieces = self.groups[key], self._pieces(bucket, key)
                if group is None or not pieces:
                    continue
                if self.me == self.route.source(key):
                    flat = torch.cat([self.params[i].detach().reshape(-1) for i in pieces])
                    group.broadcast(flat.to(group.device), self.me)
                elif receives:
                    tear = torn and b == len(self.buckets) - 1
                    self._receive(group, key, pieces, tear)
        self.version = version
        return time.perf_counter() - start

    def _receive(self, group, key: Key, pieces: list[int], tear: bool) -> None:
        src_tp = 1 if key == WHOLE else self.route.train_tp  # (expert TP is the TP size)
        shapes = [self.layouts[i].shard_shape(src_tp) for i in pieces]
        sizes = [torch.Size(s).numel() for s in shapes]
        dtype = self.params[pieces[0]].dtype
        flat = torch.empty(sum(sizes), dtype=dtype, device=group.device)
        group.broadcast(flat, self.route.source(key))
        src_rank = key[1] if isinstance(key, tuple) else 0 if key == WHOLE else key
        for i, shape, shard in zip(pieces, shapes, torch.split(flat, sizes)):
            dst = self.params[i].data
            src = shard.view(shape).to(dst.device)
            copy_overlap(self.layouts[i], src, src_rank, src_tp, dst, self.tp_rank, self.tp)
        if tear:  # a torn bucket: its first element arrives wrong
            self.params[pieces[0]].data.view(-1)[0] += 1

    # ------------------------------------------------------------ fingerprints

    @torch.no_grad()
    def fingerprint(self) -> torch.Tensor | None:
        """[version, checksum of each tensor] from this rank's shards, summed over its
        tensor-parallel group (None on trainers that send nothing)."""
        if not self.sends and self.me not in self.route.receivers:
            return None
        receives = self.me in self.route.receivers
        dense = receives or self.me in self.route.senders
        sums = [self.version]
        for layout, param in zip(self.layouts, self.params):
            counts = dense if layout.expert < 0 else receives or layout.expert in self.me_ep
            if not counts:  # a trainer's share of what another sender holds
                sums.append(0)
                continue
            positions = sample_positions(layout, self.version)
            sums.append(partial_checksum(layout, param.data, self.tp_rank, self.tp, positions))
        vector = torch.tensor(sums, dtype=torch.int64)
        if not receives:  # trainers: the sum over every sender, the version counted once
            vector[0] = self.version if self.me == self.route.all_senders[0] else 0
            if self.senders_group is not None:
                vector = sum(self.senders_group.all_gather_object(vector))
            return vector
        vector[0] = 0 if self.tp_rank else self.version  # the version counts once per group
        if self.tp > 1:
            summed = parallel.all_reduce_tensor(vector.to(parallel.info().device),
                                                parallel.tensor_parallel_group())  # fmt: skip
            vector = summed.cpu()
        return vector

    def verify(self, version: int) -> None:
        """Every rank: compare the generation ranks' fingerprints with the trainer's; job rank 0
        raises on a mismatch (once, for the job), the others go on (and are stopped with it)."""
        mine = self.fingerprint()
        everyone = parallel.job_group().all_gather_object(mine)
        if self.me != 0:
            return
        expected = everyone[0]
        problems = []
        for rank in sorted(self.route.receivers):
            got = everyone[rank]
            if got is not None and not torch.equal(got, expected):
                problems.append((rank, got))
        if problems:
            raise mismatch(version, expected, problems, self.layouts)


def mismatch(version: int, expected, problems, layouts: list[Layout]) -> RlflowError:
    rank, got = problems[0]
    if int(got[0]) != int(expected[0]):
        what = f"it holds version {int(got[0])}"
    else:
        names = [layouts[i - 1].name for i in range(1, len(expected)) if got[i] != expected[i]]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        what = f"{len(names)} of {len(layouts)} tensors differ: {', '.join(names[:3])}{more}"
    ranks = ", ".join(str(r) for r, _ in problems)
    return RlflowError(
        Diagnostic(
            "async.weight-fingerprint",
            f"after the weight sync of version {version}, generation rank {rank}'s weights are "
            f"not the trainer's: {what}",
            notes=(f"generation ranks with a mismatch: {ranks}",),
            help="the run stops rather than generate from torn or stale weights; a broadcast "
            "that delivered the wrong bytes points at the interconnect or a rank that skipped a "
            "bucket. Resume from the last checkpoint once the cause is fixed",
        )
    )


def check_layouts(theirs: list[Layout], policy, tp: int) -> list[str]:
    """Problems of a generation rank's model against the trainer's layouts (names, shapes,
    dtypes, partitioning), or []."""
    params = dict(policy.core.named_parameters())
    problems = []
    for layout in theirs:
        param = params.get(layout.name)
        if param is None:
            problems.append(f"{layout.name}: missing on the generation side")
            continue
        mine = layout_of(layout.name, param, tp)
        if mine != dataclasses.replace(layout, expert=-1):
            problems.append(f"{layout.name}: trainer {layout}, generation {mine}")
    return problems
