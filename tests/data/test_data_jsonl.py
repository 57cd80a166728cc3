"""JSONL loader on real files in a tmp dir: R1-V layout, and errors naming file, line and key."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from rlflow.data import build_dataset
from rlflow.errors import RlflowError


@pytest.fixture
def images(tmp_path):
    """Three PNGs under tmp_path/images (one grayscale: rows must come out RGB)."""
    root = tmp_path / "images"
    root.mkdir()
    for name, mode in (("a.png", "RGB"), ("b.png", "L"), ("c.png", "RGB")):
        Image.new(mode, (40, 30), 90).save(root / name)
    return root


def write_jsonl(path, lines) -> str:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def load(configs, path, image_root=None, num_samples=64):
    return build_dataset(
        *configs("jsonl", path=path, image_root=image_root, num_samples=num_samples)
    )


def test_r1v_rows_load(configs, images, tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {
                "image": "a.png",
                "problem": "How many items are there in the image?",
                "solution": "<answer> 3 </answer>",
            },
            {"image_path": "b.png", "problem": "<image>How many spheres?", "solution": "2"},
            "",  # blank lines are skipped
            {"image": str(images / "c.png"), "problem": "Count.", "solution": 4, "id": "row-c"},
        ],
    )
    dataset = load(configs, path, image_root=str(images))
    assert len(dataset) == 3
    rows = [dataset[i] for i in range(3)]
    assert [r.answer for r in rows] == ["3", "2", "4"]
    assert [r.id for r in rows] == ["train.jsonl:1", "train.jsonl:2", "row-c"]
    assert rows[1].question == "How many spheres?"  # the literal marker is dropped
    assert {(r.media, r.images[0].mode, r.images[0].size) for r in rows} == {
        ("image", "RGB", (40, 30))
    }


def test_image_root_defaults_to_the_files_directory(configs, images):
    path = write_jsonl(images / "rows.jsonl", [{"image": "a.png", "problem": "?", "solution": "1"}])
    assert load(configs, path)[0].images[0].size == (40, 30)


def test_num_samples_caps_the_rows(configs, images, tmp_path):
    rows = [{"image": "a.png", "problem": "?", "solution": str(i)} for i in range(5)]
    rows.append("{not json")  # past the cap: never read
    dataset = load(configs, write_jsonl(tmp_path / "t.jsonl", rows), str(images), num_samples=3)
    assert [dataset[i].answer for i in range(len(dataset))] == ["0", "1", "2"]


def error_of(configs, path, image_root=None) -> RlflowError:
    with pytest.raises(RlflowError) as caught:
        load(configs, path, image_root)
    return caught.value


def test_missing_key_names_file_line_and_key(configs, images, tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"image": "a.png", "problem": "?", "solution": "1"},
            {"image": "a.png", "solution": "1"},
            {"image": "a.png", "problem": "?"},
            {"problem": "?", "solution": "1"},  # no media: a text row, valid
        ],
    )
    error = error_of(configs, path, str(images))
    assert [(d.code, d.file, d.line) for d in error.diagnostics] == [
        ("data.jsonl-missing-key", path, 2),
        ("data.jsonl-missing-key", path, 3),
    ]
    assert "line 2 has no `problem` (it has: image, solution)" in error.diagnostics[0].message
    assert "line 3 has no `solution` (it has: image, problem)" in error.diagnostics[1].message
    assert "`answer` for `solution`" in error.diagnostics[1].help
    assert f"--> {path}:2" in str(error)


def test_bad_json_names_file_line_and_column(configs, images, tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"image": "a.png", "problem": "?", "solution": "1"},
            '{"image": "a.png", "problem": "?" "solution": "1"}',
            "[1, 2]",
        ],
    )
    first, second = error_of(configs, path, str(images)).diagnostics
    assert (first.code, first.line, first.column) == (
        "data.jsonl-bad-json",
        2,
        35,
    )  # the 1-based column of "solution"
    assert "line 2 is not valid JSON: Expecting ',' delimiter" in first.message
    assert (second.code, second.line) == ("data.jsonl-bad-row", 3)


def test_bad_values_are_named(configs, images, tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"image": "a.png", "problem": "", "solution": "1"},
            {"image": "a.png", "problem": "?", "solution": "<answer>  </answer>"},
            {"image": "a.png", "problem": "?", "solution": None},
            {"image": 7, "problem": "?", "solution": "1"},
        ],
    )
    messages = [d.message for d in error_of(configs, path, str(images)).diagnostics]
    assert messages == [
        "line 1: `problem` must be a non-empty string",
        "line 2: `solution` '<answer>  </answer>' holds no answer",
        "line 3: `solution` must be a non-empty string (or a number for `solution`)",
        "line 4: `image` must be a path or a list of paths",
    ]


def test_missing_image_is_named(configs, images, tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl", [{"image": "nope.png", "problem": "?", "solution": "1"}]
    )
    (problem,) = error_of(configs, path, str(images)).diagnostics
    assert (problem.code, problem.line) == ("data.jsonl-missing-image", 1)
    assert f"`image` {images / 'nope.png'} does not exist" in problem.message
    assert "set data.train.image_root" in problem.help and str(images) in problem.help


def test_unreadable_image_fails_when_read(configs, images, tmp_path):
    (images / "broken.png").write_text("not a png")
    path = write_jsonl(
        tmp_path / "t.jsonl", [{"image": "broken.png", "problem": "?", "solution": "1"}]
    )
    dataset = load(configs, path, str(images))
    with pytest.raises(RlflowError, match="cannot read image .*broken.png") as caught:
        dataset[0]
    assert caught.value.diagnostics[0].line == 1


def test_missing_or_empty_file(configs, tmp_path):
    missing = str(tmp_path / "absent.jsonl")
    (problem,) = error_of(configs, missing).diagnostics
    assert problem.message == f"JSONL file {missing} does not exist"
    assert problem.help.startswith("set data.train.path to an existing file")
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    assert error_of(configs, empty).diagnostics[0].code == "data.jsonl-empty"


def test_many_problems_are_capped_with_a_count(configs, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ["{"] * 25)
    problems = error_of(configs, path).diagnostics
    assert len(problems) == 10
    assert problems[-1].notes == ("15 more problems in this file not shown",)


def test_jsonl_without_path_names_the_split_key():
    """The recipe's rule (rlflow.rules.checks), run before any dataset is built."""
    from pathlib import Path

    from rlflow.rules import load_checked

    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"
    with pytest.raises(
        RlflowError, match="`data.train.kind` is jsonl, but `data.train.path` is not set"
    ):
        load_checked(tiny, ["data.train.kind=jsonl"])
