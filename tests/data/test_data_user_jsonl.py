"""Datasets from a user's files: JSONL directories, text/image/video rows, extra columns and the
prompt template, and errors naming file, line and field. Real files in a tmp dir."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from rlflow.data import build_dataset
from rlflow.errors import RlflowError


def write_jsonl(path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def media(tmp_path):
    """images/a.png, clip.gif (5 frames), frames/ (3 PNGs) and a file that is no video."""
    (tmp_path / "images").mkdir()
    Image.new("RGB", (40, 30), "red").save(tmp_path / "images" / "a.png")
    colours = ["red", "green", "blue", "white", "black"]
    first, *rest = [Image.new("RGB", (32, 32), c) for c in colours]
    first.save(tmp_path / "clip.gif", save_all=True, append_images=rest, duration=100)
    (tmp_path / "frames").mkdir()
    for i, colour in enumerate(colours[:3]):
        Image.new("RGB", (28, 28), colour).save(tmp_path / "frames" / f"{i:02d}.png")
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00 not a video")
    return tmp_path


def dataset(configs, path, num_frames=4, template="{question}", num_samples=64):
    split, data = configs(
        "jsonl", path=path, num_samples=num_samples, num_frames=num_frames, prompt_template=template
    )
    return build_dataset(split, data)


def error_of(*args, **kwargs) -> RlflowError:
    with pytest.raises(RlflowError) as caught:
        dataset(*args, **kwargs)[0]
    return caught.value


def test_a_directory_of_files_with_text_image_and_video_rows(configs, media):
    write_jsonl(media / "part-0.jsonl", [
        {"question": "What is 2 + 3?", "answer": 5, "source": "arith", "level": 1},
        {"image": "images/a.png", "problem": "What colour?", "solution": "<answer> red </answer>"},
    ])  # fmt: skip
    write_jsonl(media / "part-1.jsonl", [
        {"video": "clip.gif", "prompt": "Which colour comes last?", "answer": "black", "id": "v1"},
        {"video": "frames", "question": "How many frames?", "answer": "3"},
        {"video": ["frames/00.png", "frames/02.png"], "question": "First?", "answer": "red"},
        {"images": ["images/a.png", "images/a.png"], "question": "Same?", "answer": "yes"},
    ])  # fmt: skip
    (media / "notes.txt").write_text("not JSONL: ignored")
    rows = [dataset(configs, str(media))[i] for i in range(6)]
    assert [r.media for r in rows] == ["text", "image", "video", "video", "video", "image"]
    assert [r.id for r in rows] == [
        "part-0.jsonl:1", "part-0.jsonl:2", "v1", "part-1.jsonl:2", "part-1.jsonl:3", "part-1.jsonl:4",
    ]  # fmt: skip
    assert [r.answer for r in rows] == ["5", "red", "black", "3", "red", "yes"]
    assert rows[0].fields == {"source": "arith", "level": 1} and rows[1].fields == {}
    # video frames: num_frames=4 spread over the clip (5 -> indices 0, 1, 2, 3), all RGB
    clip = rows[2].video
    assert len(clip) == 4 and {f.size for f in clip} == {(32, 32)}
    assert [f.getpixel((0, 0)) for f in clip][0] == (255, 0, 0)
    assert len(rows[3].video) == 4 and len(rows[4].video) == 4  # short clips repeat frames
    assert len(rows[5].images) == 2


def test_the_prompt_template_uses_extra_columns(configs, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "Sum?", "answer": "5", "hint": "add"}])
    (row,) = [dataset(configs, path, template="{question} Hint: {hint}.")[0]]
    assert row.question == "Sum? Hint: add."
    assert row.fields == {"hint": "add"}


def test_a_template_column_missing_from_a_row_is_named(configs, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"question": "Sum?", "answer": "5", "hint": "add"}, {"question": "Sum?", "answer": "5"},
    ])  # fmt: skip
    (problem,) = error_of(configs, path, template="{question} Hint: {hint}").diagnostics
    assert (problem.code, problem.file, problem.line) == ("data.jsonl-missing-key", path, 2)
    assert "data.prompt_template uses {hint}, but the row has no `hint` column" in problem.message


def test_a_row_without_an_answer_is_named(configs, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "Sum?", "hint": "add"}])
    (problem,) = error_of(configs, path).diagnostics
    assert (problem.file, problem.line) == (path, 1)
    assert "line 1 has no `solution` (it has: hint, question)" in problem.message
    assert "`answer` for `solution`" in problem.help


def test_missing_media_are_named_with_file_line_and_field(configs, media):
    path = write_jsonl(media / "t.jsonl", [
        {"image": ["images/a.png", "images/b.png"], "question": "?", "answer": "1"},
        {"video": "clips/gone.gif", "question": "?", "answer": "1"},
        {"image": "images/a.png", "video": "clip.gif", "question": "?", "answer": "1"},
    ])  # fmt: skip
    problems = error_of(configs, path).diagnostics
    assert [(p.code, p.line) for p in problems] == [
        ("data.jsonl-missing-image", 1),
        ("data.jsonl-missing-video", 2),
        ("data.jsonl-bad-row", 3),
    ]
    assert f"`image` {media / 'images' / 'b.png'} does not exist" in problems[0].message
    assert f"`video` {media / 'clips' / 'gone.gif'} does not exist" in problems[1].message


def test_an_unreadable_video_fails_when_read_naming_file_line_and_field(configs, media):
    path = write_jsonl(media / "t.jsonl", [
        {"question": "?", "answer": "1"}, {"video": "broken.mp4", "question": "?", "answer": "1"},
    ])  # fmt: skip
    rows = dataset(configs, path)
    assert rows[0].media == "text"
    with pytest.raises(RlflowError) as caught:
        rows[1]
    (problem,) = caught.value.diagnostics
    assert (problem.code, problem.file, problem.line) == ("data.jsonl-bad-video", path, 2)
    assert problem.message.startswith(f"`video`: cannot read video {media / 'broken.mp4'}")
    assert "animated GIF" in problem.help


def test_video_rows_need_the_video_settings(configs, media):
    path = write_jsonl(media / "t.jsonl", [{"video": "clip.gif", "question": "?", "answer": "1"}])
    (problem,) = error_of(configs, path, num_frames=None).diagnostics
    assert problem.code == "data.jsonl-video-frames" and problem.line == 1
    assert "set data.video.num_frames" in problem.help


def test_validation_reads_its_own_file(configs, tmp_path):
    import dataclasses

    train = write_jsonl(tmp_path / "train.jsonl", [{"question": "a?", "answer": "1"}] * 3)
    val = write_jsonl(tmp_path / "val" / "v.jsonl", [{"question": "b?", "answer": "2"}])
    split, data = configs("jsonl", path=train)
    data = dataclasses.replace(
        data, validation=dataclasses.replace(data.validation, kind="jsonl", path=val)
    )
    assert len(build_dataset(data.train, data)) == 3
    validation = build_dataset(data.validation, data)
    assert len(validation) == 1 and validation[0].id == "v.jsonl:1"
