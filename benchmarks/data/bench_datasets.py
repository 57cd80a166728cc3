"""Rows per second of each synthetic kind, JSONL build time, and score() throughput.

    uv run python benchmarks/data/bench_datasets.py

Results go to benchmarks/data/RESULTS.md by hand (with the machine and the command).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from PIL import Image

from rlflow.data import build_dataset, reference_completion, score
from rlflow.rules import load_checked

BASE = Path(__file__).resolve().parents[2] / "recipes" / "base.yaml"


def rows_per_second(dataset, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        dataset[i]
    return n / (time.perf_counter() - start)


def synthetic(data) -> None:
    video = dataclasses.replace(data.video, num_frames=8, temporal_patch_size=2, fps=2.0)
    for size in (56, 112, 448):
        cfg = dataclasses.replace(
            data, image_size=size, max_objects=10 if size == 448 else 4, video=video
        )
        for kind in ("clevr", "video", "text", "mixed"):
            split = dataclasses.replace(data.train, kind=kind, num_samples=2000)
            rate = rows_per_second(build_dataset(split, cfg), 2000)
            print(f"| {kind} | {size} | {cfg.max_objects} | {rate:,.0f} |")


def jsonl(data, rows: int = 20_000) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        Image.new("RGB", (480, 320), 90).save(root / "a.png")
        line = '{"image": "a.png", "problem": "How many items are there?", "solution": "<answer> 3 </answer>"}\n'
        (root / "t.jsonl").write_text(line * rows)
        split = dataclasses.replace(
            data.train, kind="jsonl", path=str(root / "t.jsonl"), image_root=None, num_samples=rows
        )
        start = time.perf_counter()
        dataset = build_dataset(split, data)
        built = time.perf_counter() - start
        print(
            f"jsonl: build (parse + check) {rows} rows: {built:.2f} s; "
            f"read rows with a 480x320 PNG: {rows_per_second(dataset, 2000):,.0f} rows/s"
        )


def scoring(data, rows: int = 4096) -> None:
    split = dataclasses.replace(data.train, kind="text", num_samples=rows)
    samples = [build_dataset(split, data)[i] for i in range(rows)]
    completions = [reference_completion(s) for s in samples]
    start = time.perf_counter()
    score(completions, samples, {"format": 0.2, "exact_match": 0.8})
    print(f"score(): {rows / (time.perf_counter() - start):,.0f} rollouts/s")


if __name__ == "__main__":
    data = load_checked(BASE).recipe.data
    print("| kind | image_size | max_objects | rows/s |\n|---|---|---|---|")
    synthetic(data)
    jsonl(data)
    scoring(data)
