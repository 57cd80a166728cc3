"""Hostile JSONL input: each is refused with a diagnostic naming the file and line, by the dry
run (the recipe checks read the first rows of each split) and by the trainer's dataset, never a
traceback. Real files in a tmp dir; the dry run through the console script where its exit code
and memory matter."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from rlflow.data import build_dataset
from rlflow.errors import RlflowError
from rlflow.rules import load_checked

ROOT = Path(__file__).resolve().parents[2]
RLFLOW = ROOT / ".venv" / "bin" / "rlflow"
TINY = ROOT / "recipes" / "tiny-qwen25vl-clevr-1n1g-cpu.yaml"


def png_header(path: Path, width: int, height: int) -> None:
    """A PNG that claims width x height pixels (PIL reads the size from IHDR when it opens it)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 16)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def dry_run_error(tmp_path: Path, path: str) -> str:
    """The recipe checks of a recipe whose train split is `path` (as `rlflow submit --dry-run`
    and `rlflow train` run them): the rendered diagnostics."""
    with pytest.raises(RlflowError) as caught:
        load_checked(TINY, ["data.train.kind=jsonl", f"data.train.path={path}"])
    return str(caught.value)


def line(**row) -> str:
    return json.dumps(row) + "\n"


@pytest.mark.parametrize(
    "name, content, said",
    [
        ("empty.jsonl", "", "(data.train.path) has no rows"),
        (
            "bad-utf8.jsonl",
            b'{"question": "q", "answer": "\xff\xfe"}\n',
            "line 1 is not valid UTF-8",
        ),
        ("nan.jsonl", '{"question": "q", "answer": NaN}\n', "`NaN` is not a JSON value"),
        ("inf.jsonl", '{"question": "q", "answer": -Infinity}\n', "`-Infinity` is not a JSON"),
        ("marker.jsonl", line(question=" <image> <IMAGE>", answer="3"), "holds only <image>"),
    ],
)
def test_the_dry_run_reads_the_first_rows(tmp_path, name, content, said):
    target = tmp_path / name
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    text = dry_run_error(tmp_path, str(target))
    assert said in text, text
    assert str(target) in text


def test_a_directory_whose_only_jsonl_is_a_directory(tmp_path):
    (tmp_path / "rows.jsonl").mkdir()
    text = dry_run_error(tmp_path, str(tmp_path))
    assert "has no *.jsonl files (rows.jsonl: a directory, not a file)" in text
    (tmp_path / "rows.jsonl").rmdir()
    (tmp_path / "notes.txt").write_text("hello\n")
    assert "has no *.jsonl files" in dry_run_error(tmp_path, str(tmp_path))


def test_a_decompression_bomb_is_named_at_the_dry_run_and_when_read(tmp_path, configs):
    png_header(tmp_path / "bomb.png", 20000, 20000)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(line(image="bomb.png", question="How many?", answer="3"))
    text = dry_run_error(tmp_path, str(rows))
    assert "`image`: image" in text and "bomb.png is too large" in text and "rows.jsonl:1" in text
    split, data = configs("jsonl", path=str(rows), num_samples=4)
    with pytest.raises(RlflowError, match="bomb.png is too large to decode"):
        build_dataset(split, data)[0]


def test_a_100_mb_row_is_refused_by_the_dry_run_without_reading_it_whole(tmp_path):
    """The row is 100 MiB (sparse on disk: the middle is zeros): refused in one streaming pass.
    The dry run's peak memory stays far below the row (json.loads would hold it several times)."""
    rows = tmp_path / "rows.jsonl"
    with rows.open("wb") as out:
        out.write(b'{"question": "')
        out.seek(100 * 2**20)
        out.write(b'", "answer": "3"}\n' + line(question="fine?", answer="1").encode())
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"defaults: {TINY}\ndata:\n  train: {{kind: jsonl, path: {rows}}}\n")
    # A parent of its own reports the dry run's peak memory (RUSAGE_CHILDREN: its only child).
    measure = (
        "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
        "print('peak KiB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"
    )
    command = [str(RLFLOW), "submit", str(recipe), "--nodes", "1", "--gpus", "1", "--dry-run"]
    result = subprocess.run(
        [sys.executable, "-c", measure, *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "line 1 is 100.0 MiB, more than the 4 MiB a row may hold" in result.stderr
    assert "Traceback" not in result.stderr
    peak_mib = int(result.stdout.split("peak KiB")[1]) / 1024
    assert peak_mib < 150, f"the dry run peaked at {peak_mib:.0f} MiB for a 100 MiB row"
