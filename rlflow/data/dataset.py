"""build_dataset: a recipe's `data.<split>` section -> a deterministic, lazily generated Dataset.

Synthetic rows are made on access from (seed, kind, index), so `dataset[i]` is the same
sample in every process and after every restart, and nothing is rendered up front.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from rlflow.data.sample import Sample
from rlflow.data.scene import SceneSpec, grid_for
from rlflow.data.seeding import derive_seed, row_rng

if TYPE_CHECKING:
    from rlflow.recipe.schema import DataConfig, DatasetConfig

SYNTHETIC_KINDS = ("clevr", "video", "text")


class Dataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Sample: ...


def build_dataset(
    split_cfg: DatasetConfig, data_cfg: DataConfig, *, condition: str | None = None
) -> Dataset:
    """The dataset a split describes. `condition` ("A" | "B") restricts synthetic scenes to a
    CLEVR-CoGenT colour/shape condition: train on A, validate on B for unseen combinations."""
    if split_cfg.kind == "jsonl":
        from rlflow.data.jsonl import JsonlDataset

        split = _split_name(split_cfg, data_cfg)
        assert split_cfg.path, "check_recipe refuses a jsonl split without a path"
        return JsonlDataset(
            split_cfg.path,
            split_cfg.image_root,
            split_cfg.num_samples,
            split,
            template=data_cfg.prompt_template,
            num_frames=data_cfg.video.num_frames,
        )
    spec = SceneSpec(
        data_cfg.image_size, data_cfg.max_objects, data_cfg.video.num_frames, condition
    )
    grid_for(spec.image_size, spec.max_objects)  # raises now if the objects cannot fit the image
    if split_cfg.kind == "mixed":
        kinds = mixed_kinds(split_cfg.num_samples, split_cfg.seed, data_cfg.mix)
    else:
        kinds = [split_cfg.kind] * split_cfg.num_samples
    assert "video" not in kinds or spec.num_frames, "check_recipe refuses video rows without frames"
    return SyntheticDataset(kinds, split_cfg.seed, spec)


class SyntheticDataset:
    """Row i is generated from (seed, kinds[i], i) on every access."""

    def __init__(self, kinds: list[str], seed: int, spec: SceneSpec):
        self.kinds, self.seed, self.spec = kinds, seed, spec

    def __len__(self) -> int:
        return len(self.kinds)

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self.kinds):
            raise IndexError(f"row {index} is outside a dataset of {len(self.kinds)} rows")
        kind = self.kinds[index]
        make = _generators()[kind]
        return make(row_rng(self.seed, kind, index), f"{kind}/{self.seed}/{index}", self.spec)


def mixed_kinds(num_samples: int, seed: int, mix: Mapping[str, float]) -> list[str]:
    """Each row's kind: counts exactly proportional to `mix` (largest remainder), seeded order.
    `mix` has passed check_recipe (known kinds, shares adding up to more than 0)."""
    shares = {k: max(mix[k], 0) for k in SYNTHETIC_KINDS if mix.get(k, 0) > 0}
    total = sum(shares.values())
    exact = {k: num_samples * s / total for k, s in shares.items()}
    counts = {k: int(v) for k, v in exact.items()}
    by_remainder = sorted(shares, key=lambda k: (counts[k] - exact[k], k))
    for kind in by_remainder[: num_samples - sum(counts.values())]:
        counts[kind] += 1
    kinds = [k for k in shares for _ in range(counts[k])]
    random.Random(derive_seed(seed, "mix")).shuffle(kinds)
    return kinds


def _split_name(split_cfg: DatasetConfig, data_cfg: DataConfig) -> str:
    """ "train" or "validation" for error messages that name the recipe key to change."""
    if split_cfg is data_cfg.validation:
        return "validation"
    return "train" if split_cfg is data_cfg.train else "<split>"


def _generators() -> dict[str, Callable[..., Sample]]:
    # Imported on first use: PIL loads only when rows are made, not when recipes are checked.
    from rlflow.data.clevr import make_clevr_row
    from rlflow.data.text import make_text_row
    from rlflow.data.video import make_video_row

    return {"clevr": make_clevr_row, "video": make_video_row, "text": make_text_row}
