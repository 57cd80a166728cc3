"""Which ranks of a job train and which generate: the `Placement` of `generation.placement`,
and whether the trainer splits activations over its TP ranks (`splits_sequence`).

Plain types and answers, below everything that reads them (rlflow.parallel builds each role's
process groups from them); rlflow.rules.allocation decides the placement from the recipe and
the job's nodes x GPUs, and refuses what cannot run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from rlflow.frozen import frozen

if TYPE_CHECKING:
    from rlflow.recipe.schema import ParallelismConfig

Role = Literal["train", "generate"]


@frozen
class Placement:
    """Which ranks of a job train and which generate (`generation.placement`).

    colocated: every rank trains and generates its own rollouts (`generation` is empty).
    separate: `generation` ranks run only the generation engine; the others only train. Rank 0
    always trains (it writes the metrics and the checkpoints).
    """

    training: tuple[int, ...]
    generation: tuple[int, ...]

    @property
    def separate(self) -> bool:
        return bool(self.generation)

    def role(self, rank: int) -> Role:
        return "generate" if rank in self.generation else "train"

    def ranks(self, role: Role) -> tuple[int, ...]:
        return self.generation if role == "generate" else self.training

    def describe(self) -> str:
        """`ranks 0-1 train, rank 2 generates` (the dry run and the job log show this)."""
        train = f"rank{'s' * (len(self.training) != 1)} {_spans(self.training)} train"
        if not self.separate:
            return f"{train} and generate (placement colocated)"
        many = len(self.generation) != 1
        return f"{train}, rank{'s' * many} {_spans(self.generation)} generate{'' if many else 's'}"


def _spans(ranks: tuple[int, ...]) -> str:
    """(0, 1, 2, 5, 7, 8) -> `0-2, 5, 7-8`."""
    out, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            out.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(out)


def splits_sequence(par: ParallelismConfig) -> bool:
    """Whether the trainer splits activations over the TP ranks (`parallelism.sequence_parallel`:
    auto is on when TP > 1; the recipe rules refuse "on" at TP=1). rlflow.parallel and the allocation rules ask this."""
    if par.sequence_parallel == "auto":
        return par.tensor_parallel_size > 1
    return par.sequence_parallel == "on"
