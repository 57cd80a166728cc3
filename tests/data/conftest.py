"""Recipe-shaped configs for the data tests, taken from recipes/base.yaml (the real defaults)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlflow.rules import load_checked

BASE_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "base.yaml"


@pytest.fixture(scope="session")
def base_data():
    return load_checked(BASE_RECIPE).recipe.data


@pytest.fixture
def configs(base_data):
    """configs(kind, seed=..., num_samples=..., image_size=..., ...) -> (split_cfg, data_cfg)."""

    def make(
        kind: str = "clevr",
        *,
        seed: int = 1,
        num_samples: int = 64,
        path=None,
        image_root=None,
        num_frames: int | None = 4,
        **data_overrides,
    ):
        split = dataclasses.replace(
            base_data.train,
            kind=kind,
            seed=seed,
            num_samples=num_samples,
            path=path,
            image_root=image_root,
        )
        video = dataclasses.replace(
            base_data.video,
            num_frames=num_frames,
            temporal_patch_size=2 if num_frames else None,
            fps=2.0 if num_frames else None,
        )
        data = dataclasses.replace(base_data, train=split, video=video, **data_overrides)
        return split, data

    return make
