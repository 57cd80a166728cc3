"""PromptSampler: an endless, seeded stream of index batches that a checkpoint can resume."""

from __future__ import annotations

import random

from rlflow.data.seeding import derive_seed
from rlflow.errors import Diagnostic, RlflowError


class PromptSampler:
    """Yields `batch_size` dataset indices per step, forever.

    Each epoch is a fresh permutation drawn from (seed, epoch); a batch that reaches the end of
    an epoch continues into the next one, so every row is seen once per epoch and no row is
    dropped. `state_dict()` is the position (epoch, offset): a run resumed from it draws exactly
    the batches the uninterrupted run would have drawn.
    """

    def __init__(self, dataset_len: int, batch_size: int, seed: int):
        if dataset_len < 1 or batch_size < 1:
            raise ValueError(
                f"dataset_len ({dataset_len}) and batch_size ({batch_size}) must be >= 1"
            )
        self.dataset_len, self.batch_size, self.seed = dataset_len, batch_size, seed
        self._seek(epoch=0, position=0)

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[int]:
        batch = []
        while len(batch) < self.batch_size:
            if self._position == self.dataset_len:
                self._seek(self._epoch + 1, 0)
            batch.append(self._order[self._position])
            self._position += 1
        return batch

    @property
    def epoch(self) -> int:
        return self._epoch

    def state_dict(self) -> dict[str, int]:
        return {
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "epoch": self._epoch,
            "position": self._position,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; the dataset size and seed must be the saved ones."""
        for key in ("dataset_len", "seed"):
            if state[key] != getattr(self, key):
                raise RlflowError(
                    Diagnostic(
                        "data.resume-mismatch",
                        f"the checkpoint's data position was saved with {key}={state[key]}, "
                        f"but this run has {key}={getattr(self, key)}",
                        help="resume with the recipe the run started with, or start a new run "
                        "directory to train on different data",
                    )
                )
        self._seek(state["epoch"], state["position"])

    def _seek(self, epoch: int, position: int) -> None:
        self._epoch, self._position = epoch, position
        self._order = list(range(self.dataset_len))
        random.Random(derive_seed(self.seed, "epoch", epoch)).shuffle(self._order)
