"""Writes data/ (the user-format dataset the end-to-end test trains on), once; kept in git.

    uv run python tests/user_task/make_data.py

Rows come from rlflow's own scene generator, written out as a user would have them: PNG files,
GIF clips and JSONL lines with an extra `objects` column (the scene's object count) that the
reward module reads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlflow.data.clevr import make_clevr_row
from rlflow.data.scene import SceneSpec
from rlflow.data.text import make_text_row
from rlflow.data.video import make_video_row

HERE = Path(__file__).resolve().parent / "data"


def write(split: str, seed: int, kinds: list[str], files: int) -> None:
    """data/<split>/: `files` JSONL files, media in images/ and clips/ beside them."""
    folder = HERE / split
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "clips").mkdir(exist_ok=True)
    spec = SceneSpec(56, 3, 4, None)
    lines = []
    for i, kind in enumerate(kinds):
        rng = random.Random(seed * 1000 + i)
        make = {"image": make_clevr_row, "video": make_video_row, "text": make_text_row}[kind]
        sample = make(rng, f"{split}-{i}", spec)
        row = {
            "problem" if i % 2 else "question": sample.question,
            "objects": len(sample.scene.objects),
        }
        row["solution" if i % 3 else "answer"] = f"<answer> {sample.answer} </answer>"
        if kind == "image":
            name = f"images/{split}-{i:03d}.png"
            sample.images[0].save(folder / name)
            row["image"] = name
        elif kind == "video":
            name = f"clips/{split}-{i:03d}.gif"
            first, *rest = sample.video
            first.save(folder / name, save_all=True, append_images=rest, duration=500, loop=0)
            row["video"] = name
        lines.append(json.dumps(row))
    share = -(-len(lines) // files)
    for n in range(files):
        part = lines[n * share : (n + 1) * share]
        name = f"part-{n}.jsonl" if files > 1 else f"{split}.jsonl"
        (folder / name).write_text("\n".join(part) + "\n")


def main() -> None:
    write("train", 1, ["image"] * 20 + ["text"] * 8 + ["video"] * 4, files=2)
    write("validation", 2, ["image"] * 6 + ["text"] * 2, files=1)


if __name__ == "__main__":
    main()
