"""Real data in the CLEVR-CoGenT / R1-V JSONL layout: one JSON object per line.

    {"image": "images/000017.png", "problem": "How many items are there?", "solution": "<answer> 3 </answer>"}

`image` (or `image_path`) is relative to `image_root` (by default the JSONL file's directory);
`solution` is "<answer> N </answer>", a bare answer, or a number. Every used line is checked when
the dataset is built, so a bad row fails before the job spends GPU time; images are opened only
when a row is read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from rlflow.data.rewards import extract_answer
from rlflow.data.sample import Sample
from rlflow.errors import Diagnostic, RlflowError

IMAGE_KEYS = ("image", "image_path")
MAX_REPORTED = 10  # problems listed before the rest are summarised as a count
# Literal media markers in a problem would add a second set of image tokens to the prompt
# (NeMo-RL #3494: 601 placeholders for 600 features); the chat template places the image itself.
_MEDIA_MARKER_RE = re.compile(r"<image>|<video>", re.IGNORECASE)
_HELP_LAYOUT = (
    'each line must be a JSON object like {"image": "a.png", "problem": "How many ...?", '
    '"solution": "<answer> 3 </answer>"}'
)


@dataclass(frozen=True)
class JsonlRow:
    id: str
    image_path: Path
    line: int
    question: str
    answer: str


class JsonlDataset:
    """Rows of a JSONL file (the first `num_samples`); images are read on access."""

    def __init__(
        self,
        path: str | Path,
        image_root: str | Path | None,
        num_samples: int,
        split: str = "<split>",
    ):
        self.path = Path(path)
        self.rows = read_rows(self.path, image_root, num_samples, split)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Sample:
        row = self.rows[index]  # IndexError past the end, as a sequence should
        return Sample(
            id=row.id,
            media="image",
            question=row.question,
            answer=row.answer,
            images=(self._open(row),),
            kind="jsonl",
            template="jsonl",
        )

    def _open(self, row: JsonlRow):
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(row.image_path) as image:
                return image.convert("RGB")
        except (OSError, UnidentifiedImageError) as exc:
            raise RlflowError(
                Diagnostic(
                    "data.jsonl-bad-image",
                    f"cannot read image {row.image_path}: {exc}",
                    file=str(self.path),
                    line=row.line,
                    help="replace the file with a readable PNG/JPEG, or remove this line",
                )
            ) from exc


def read_rows(
    path: Path, image_root: str | Path | None, num_samples: int, split: str = "<split>"
) -> list[JsonlRow]:
    """Parse and check the first `num_samples` rows; raise with every problem found."""
    if not path.is_file():
        raise RlflowError(
            Diagnostic(
                "data.jsonl-missing-file",
                f"JSONL file {path} does not exist",
                help=f"set data.{split}.path to an existing file (relative paths start at the "
                "directory rlflow runs in)",
            )
        )
    root = Path(image_root) if image_root is not None else path.parent
    rows: list[JsonlRow] = []
    problems: list[Diagnostic] = []
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if len(rows) >= num_samples:
                break
            if text.strip():
                row = _parse_line(text, number, path, root, split, problems)
                if row is not None:
                    rows.append(row)
    if not rows and not problems:
        problems.append(
            Diagnostic(
                "data.jsonl-empty",
                f"JSONL file {path} has no rows",
                file=str(path),
                help=_HELP_LAYOUT,
            )
        )
    if problems:
        raise RlflowError(_capped(problems))
    return rows


def _parse_line(
    text: str, number: int, path: Path, root: Path, split: str, problems: list[Diagnostic]
) -> JsonlRow | None:
    def problem(code: str, message: str, help: str = _HELP_LAYOUT, column: int | None = None):
        problems.append(
            Diagnostic(code, message, file=str(path), line=number, column=column, help=help)
        )

    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        problem(
            "data.jsonl-bad-json", f"line {number} is not valid JSON: {exc.msg}", column=exc.colno
        )
        return None
    if not isinstance(record, dict):
        problem(
            "data.jsonl-bad-row", f"line {number} is a JSON {type(record).__name__}, not an object"
        )
        return None
    image_key = next((k for k in IMAGE_KEYS if k in record), None)
    missing = [k for k in ("problem", "solution") if k not in record]
    if image_key is None:
        missing.insert(0, "image")
    if missing:
        keys = ", ".join(f"`{k}`" for k in missing)
        problem(
            "data.jsonl-missing-key",
            f"line {number} has no {keys} (it has: {', '.join(sorted(record)) or 'nothing'})",
        )
        return None
    return _check_values(record, image_key, number, path, root, split, problem)


def _check_values(
    record: dict, image_key: str, number: int, path: Path, root: Path, split: str, problem
) -> JsonlRow | None:
    image, question, solution = record[image_key], record["problem"], record["solution"]
    bad = [
        k
        for k, v in ((image_key, image), ("problem", question))
        if not isinstance(v, str) or not v.strip()
    ]
    if isinstance(solution, bool) or not isinstance(solution, str | int | float):
        bad.append("solution")
    if bad:
        problem(
            "data.jsonl-bad-value",
            f"line {number}: {', '.join(f'`{k}`' for k in bad)} must be a non-empty string"
            + (" (or a number for `solution`)" if "solution" in bad else ""),
        )
        return None
    answer = _answer_from(solution)
    if not answer:
        problem(
            "data.jsonl-bad-value",
            f"line {number}: `solution` {solution!r} holds no answer",
            help='write the answer bare ("3") or tagged ("<answer> 3 </answer>")',
        )
        return None
    image_path = root / image  # an absolute `image` replaces the root
    if not image_path.is_file():
        problem(
            "data.jsonl-missing-image",
            f"line {number}: image {image_path} does not exist",
            help=f"set data.{split}.image_root to the directory the image paths start from "
            f"(now {root})",
        )
        return None
    question = _MEDIA_MARKER_RE.sub("", question).strip()
    row_id = str(record.get("id", f"{path.name}:{number}"))
    return JsonlRow(id=row_id, image_path=image_path, line=number, question=question, answer=answer)


def _answer_from(solution: str | int | float) -> str:
    if not isinstance(solution, str):
        return str(solution)
    tagged = extract_answer(solution)
    return (tagged if tagged is not None else solution).strip()


def _capped(problems: list[Diagnostic]) -> list[Diagnostic]:
    if len(problems) <= MAX_REPORTED:
        return problems
    rest = len(problems) - MAX_REPORTED
    last = problems[MAX_REPORTED - 1]
    note = f"{rest} more problem{'s' * (rest != 1)} in this file not shown"
    return problems[: MAX_REPORTED - 1] + [
        Diagnostic(
            last.code,
            last.message,
            file=last.file,
            line=last.line,
            column=last.column,
            help=last.help,
            notes=(*last.notes, note),
        )
    ]
