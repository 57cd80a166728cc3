"""Synthetic datasets: deterministic, the right shapes, and answers that match what was drawn.

The answers are checked against the pixels, not against the generator's own scene graph: a
small reader below finds each object in the rendered image, names its colour from the exact
RGB value and its shape from how much of its bounding box it fills (square 1, circle ~0.79,
triangle ~0.5), then answers the question by parsing its text.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from rlflow.data import PromptSampler, build_dataset
from rlflow.data.scene import BACKGROUND, COGENT, COLORS, grid_for
from rlflow.errors import RlflowError

COLOR_OF_RGB = {rgb: name for name, rgb in COLORS.items()}
COUNT_RE = re.compile(
    r"How many (?:(\w+) )?(square|circle|triangle|object)s (?:are there|appear in the video)\?$"
)
FRAME_RE = re.compile(r"In which frame does the (\w+) (\w+) appear\?$")
DESCRIBED_RE = re.compile(r"an? (large|small) (\w+) (square|circle|triangle)")


def read_objects(image, grid: int, cell: int) -> list[tuple[str, str]]:
    """(colour, shape) of every object drawn in `image`, found cell by cell."""
    pixels = np.asarray(image)
    found = []
    for index in range(grid * grid):
        row, col = divmod(index, grid)
        patch = pixels[row * cell : (row + 1) * cell, col * cell : (col + 1) * cell]
        mask = (patch != BACKGROUND).any(axis=2)
        if not mask.any():
            continue
        ys, xs = np.nonzero(mask)
        box = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
        centre = patch[(ys.min() + ys.max()) // 2, (xs.min() + xs.max()) // 2]
        fill = box.mean()
        shape = "square" if fill > 0.95 else "circle" if fill > 0.65 else "triangle"
        found.append((COLOR_OF_RGB[tuple(int(v) for v in centre)], shape))
    return found


def answer_by_counting(question: str, objects: list[tuple[str, str]]) -> str:
    color, shape = COUNT_RE.search(question).groups()
    shape = None if shape == "object" else shape
    return str(sum(color in (None, c) and shape in (None, s) for c, s in objects))


def pixel_bytes(sample) -> bytes:
    frames = sample.images + (sample.video or ())
    return b"".join(f.tobytes() for f in frames)


@pytest.mark.parametrize("kind", ["clevr", "video", "text", "mixed"])
def test_same_seed_same_rows_other_seed_other_rows(configs, kind):
    first, second = (build_dataset(*configs(kind, seed=7)) for _ in range(2))
    other = build_dataset(*configs(kind, seed=8))
    rows = range(12)
    same = [(first[i].question, first[i].answer, pixel_bytes(first[i])) for i in rows]
    assert same == [(second[i].question, second[i].answer, pixel_bytes(second[i])) for i in rows]
    assert same != [(other[i].question, other[i].answer, pixel_bytes(other[i])) for i in rows]


def test_rows_do_not_depend_on_access_order(configs):
    dataset = build_dataset(*configs("mixed"))
    backwards = {i: dataset[i] for i in reversed(range(10))}
    assert all(
        pixel_bytes(dataset[i]) == pixel_bytes(backwards[i])
        and dataset[i].question == backwards[i].question
        for i in range(10)
    )


@pytest.mark.parametrize("image_size, max_objects", [(112, 4), (56, 4), (100, 6), (224, 10)])
def test_clevr_answers_match_the_pixels(configs, image_size, max_objects):
    dataset = build_dataset(
        *configs("clevr", num_samples=60, image_size=image_size, max_objects=max_objects)
    )
    grid, cell = grid_for(image_size, max_objects)
    for sample in dataset:
        (image,) = sample.images
        assert (image.mode, image.size) == ("RGB", (image_size, image_size))
        objects = read_objects(image, grid, cell)
        assert sorted(objects) == sorted((o.color, o.shape) for o in sample.scene.objects)
        assert 1 <= len(objects) <= max_objects
        assert sample.answer == answer_by_counting(sample.question, objects), sample.id


def test_answers_cover_every_count(configs):
    """Scenes are made question first, so "1" is not the answer to almost everything."""
    dataset = build_dataset(*configs("clevr", num_samples=200, max_objects=4))
    answers = Counter(dataset[i].answer for i in range(len(dataset)))
    assert set(answers) == {"1", "2", "3", "4"}
    assert min(answers.values()) >= 25, answers


def test_video_frames_and_answers_match_the_pixels(configs):
    dataset = build_dataset(*configs("video", num_samples=60, num_frames=6))
    grid, cell = grid_for(112, 4)
    templates = Counter()
    for sample in dataset:
        assert sample.images == () and len(sample.video) == 6
        assert {(f.mode, f.size) for f in sample.video} == {("RGB", (112, 112))}
        per_frame = [read_objects(frame, grid, cell) for frame in sample.video]
        templates[sample.template] += 1
        if sample.template == "frame":
            color, shape = FRAME_RE.search(sample.question).groups()
            (frame,) = [t for t, objs in enumerate(per_frame) if (color, shape) in objs]
            assert sample.answer == str(frame + 1)
        else:
            seen = [obj for objs in per_frame for obj in objs]
            assert sample.answer == answer_by_counting(sample.question, seen), sample.id
    assert set(templates) == {"total", "color", "frame"}


def test_text_answers_match_the_description(configs):
    for sample in build_dataset(*configs("text", num_samples=60)):
        assert sample.media == "text" and sample.images == () and sample.video is None
        described = [(c, s) for _, c, s in DESCRIBED_RE.findall(sample.question)]
        assert len(described) == len(sample.scene.objects)
        assert sample.answer == answer_by_counting(sample.question, described)


def test_mixed_rows_follow_the_shares(configs):
    split, data = configs("mixed", num_samples=400, mix={"clevr": 0.5, "video": 0.25, "text": 0.25})
    dataset = build_dataset(split, data)
    kinds = [dataset[i].media for i in range(len(dataset))]
    assert Counter(kinds) == {"image": 200, "video": 100, "text": 100}
    batch = next(PromptSampler(len(dataset), 32, seed=0))
    in_batch = Counter(dataset[i].media for i in batch)
    assert set(in_batch) == {"image", "video", "text"}
    assert 8 <= in_batch["image"] <= 24, in_batch


def test_mixed_shares_need_not_sum_to_one(configs):
    split, data = configs("mixed", num_samples=10, mix={"clevr": 3, "text": 1, "video": 0})
    kinds = Counter(build_dataset(split, data)[i].kind for i in range(10))
    assert kinds == {"clevr": 8, "text": 2}  # 7.5 and 2.5: the tie goes to the larger share


def test_cogent_conditions_hold_out_colour_shape_combinations(configs):
    split, data = configs("clevr", num_samples=150)
    train = build_dataset(split, data, condition="A")
    validation = build_dataset(*configs("clevr", seed=2, num_samples=150), condition="B")
    seen = {(o.color, o.shape) for s in train for o in s.scene.objects}
    unseen = {(o.color, o.shape) for s in validation for o in s.scene.objects}
    assert all(color in COGENT["A"][shape] for color, shape in seen)
    assert {("red", "triangle"), ("gray", "square")} <= seen
    assert ("red", "square") in unseen and ("red", "square") not in seen


def test_out_of_range_index_is_an_index_error(configs):
    dataset = build_dataset(*configs("clevr", num_samples=3))
    assert len(list(dataset)) == 3  # iteration stops at IndexError
    with pytest.raises(IndexError, match="row 3 is outside a dataset of 3 rows"):
        dataset[3]


def test_too_many_objects_for_the_image_is_an_error(configs):
    with pytest.raises(RlflowError, match="20 objects do not fit a 56x56 image") as caught:
        build_dataset(*configs("clevr", image_size=56, max_objects=20))
    assert "lower data.max_objects to 16 or less" in str(caught.value)


@pytest.mark.parametrize(
    "overrides", [["data.train.kind=video"], ["data.train.kind=mixed", "data.mix={video: 1.0}"]]
)
def test_video_rows_need_num_frames(overrides):
    """The rule is the recipe's (rlflow.rules.checks), run before any dataset is built."""
    from rlflow.rules import load_checked

    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
    with pytest.raises(RlflowError) as caught:
        load_checked(tiny, overrides)
    assert [d.code for d in caught.value.diagnostics] == ["recipe.video-incomplete"]
    assert "the data has video rows" in caught.value.diagnostics[0].message


def test_mixed_without_video_share_needs_no_frames(configs):
    split, data = configs("mixed", num_frames=None, mix={"clevr": 1.0, "text": 1.0})
    assert {build_dataset(split, data)[i].media for i in range(20)} == {"image", "text"}
