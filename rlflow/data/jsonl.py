"""Your own data: JSONL files (one JSON object per line), or a directory of them.

    {"image": "images/000017.png", "problem": "How many items are there?", "solution": "<answer> 3 </answer>"}
    {"video": "clips/7.gif", "question": "What moves first?", "answer": "the cube", "difficulty": 2}
    {"question": "What is 2 + 3?", "answer": "5"}

- question: `problem`, `question` or `prompt`; answer: `solution` or `answer` ("<answer> N
  </answer>", a bare answer, or a number). Both are required.
- media (optional; a row with neither is text-only): `image` / `image_path` (a path, or a list
  of paths) or `video` (an animated GIF/WebP/PNG, a directory of frame images, a list of frame
  paths, or a video file when PyAV is installed). Paths are relative to `image_root`, by
  default the JSONL file's directory; absolute paths work too.
- `id` names the row (default `file.jsonl:LINE`); every other column is passed to rewards
  (`RewardBatch.fields`) and to the prompt template (`data.prompt_template`, "{question}").

Every used line is checked when the dataset is built, so a bad row fails before the job
spends GPU time, and the dry run (`rlflow submit --dry-run`, through the recipe checks) reads
the first DRY_RUN_ROWS rows of each split and their images' headers. A line is valid UTF-8
JSON (no NaN or Infinity) of at most 4 MiB (rlflow/data/lines.py): media go in files the
row names. Images and videos are decoded when a row is read; a file that cannot be decoded
then is an error naming its JSONL file, line and field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlflow.data.lines import bounded_lines
from rlflow.data.prompts import format_answer, render_question, template_fields
from rlflow.data.rewards import extract_answer
from rlflow.data.sample import Sample
from rlflow.data.video_files import read_video, uniform_frames
from rlflow.errors import Diagnostic, RlflowError

IMAGE_KEYS = ("image", "image_path", "images")
QUESTION_KEYS = ("problem", "question", "prompt")
ANSWER_KEYS = ("solution", "answer")
MAX_REPORTED = 10  # problems listed before the rest are summarised as a count
MAX_SCANNED_PROBLEMS = 100  # reading stops after this many bad lines: the file is the problem
DRY_RUN_ROWS = 100  # rows of each split the dry run reads (and whose image headers it opens)
# Literal media markers in a problem would add a second set of image tokens to the prompt
# (NeMo-RL #3494: 601 placeholders for 600 features); the chat template places the image itself.
_MEDIA_MARKER_RE = re.compile(r"<image>|<video>", re.IGNORECASE)
_HELP_LAYOUT = (
    'each line must be a JSON object like {"image": "a.png", "problem": "How many ...?", '
    f'"solution": "{format_answer(" 3 ")}"}} (image or video optional)'
)


@dataclass(frozen=True)
class JsonlRow:
    id: str
    file: Path
    line: int
    question: str
    answer: str
    image_paths: tuple[Path, ...] = ()
    video: tuple[Path, ...] | Path | None = None  # frame files, or one file/directory
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def image_path(self) -> Path:  # the first image (single-image rows)
        return self.image_paths[0]


class JsonlDataset:
    """Rows of a JSONL file or directory (the first `num_samples`); media read on access."""

    def __init__(
        self,
        path: str | Path,
        image_root: str | Path | None,
        num_samples: int,
        split: str = "<split>",
        *,
        template: str,  # data.prompt_template
        num_frames: int | None,  # data.video.num_frames (None: no video rows)
    ):
        self.path = Path(path)
        self.num_frames = num_frames
        self.rows = read_rows(
            self.path, image_root, num_samples, split, template=template, num_frames=num_frames
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Sample:
        row = self.rows[index]  # IndexError past the end, as a sequence should
        images = tuple(self._open(row, p, "image") for p in row.image_paths)
        video = self._video(row) if row.video is not None else None
        media = "video" if video is not None else "image" if images else "text"
        return Sample(
            id=row.id,
            media=media,
            question=row.question,
            answer=row.answer,
            images=images,
            video=video,
            kind="jsonl",
            template="jsonl",
            fields=row.fields,
        )

    def _open(self, row: JsonlRow, path: Path, key: str):
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except Image.DecompressionBombError as exc:
            raise _read_error(row, key, f"image {path} is too large to decode: {exc}") from exc
        except (OSError, UnidentifiedImageError) as exc:
            raise _read_error(row, key, f"cannot read image {path}: {exc}") from exc

    def _video(self, row: JsonlRow) -> tuple:
        frames = read_video(row, self._open, _read_error)
        if not frames:
            raise _read_error(row, "video", f"video {row.video} has no frames")
        return uniform_frames(frames, self.num_frames or len(frames))


def _read_error(row: JsonlRow, key: str, message: str) -> RlflowError:
    help = (
        "replace the file with a readable PNG/JPEG, or remove this line"
        if key == "image"
        else "use an animated GIF/WebP/PNG, a directory of frame images or a list of frame "
        "paths (video files need PyAV: pip install av), or remove this line"
    )
    return RlflowError(
        Diagnostic(
            "data.jsonl-bad-image" if key == "image" else "data.jsonl-bad-video",
            f"`{key}`: {message}",
            file=str(row.file),
            line=row.line,
            help=help,
        )
    )


def jsonl_files(path: Path) -> list[Path]:
    """A JSONL file, or the *.jsonl files of a directory in name order (files only)."""
    return sorted(p for p in path.glob("*.jsonl") if p.is_file()) if path.is_dir() else [path]


def read_rows(
    path: Path,
    image_root: str | Path | None,
    num_samples: int,
    split: str = "<split>",
    *,
    template: str,
    num_frames: int | None,
) -> list[JsonlRow]:
    """Parse and check the first `num_samples` rows; raise with every problem found."""
    if not path.exists():
        raise RlflowError(
            Diagnostic(
                "data.jsonl-missing-file",
                f"JSONL file {path} does not exist",
                help=f"set data.{split}.path to an existing file or directory (relative paths "
                "start at the directory rlflow runs in)",
            )
        )
    files = jsonl_files(path)
    if not files:
        folders = sorted(p.name for p in path.glob("*.jsonl") if p.is_dir())
        raise RlflowError(
            Diagnostic(
                "data.jsonl-empty",
                f"directory {path} (data.{split}.path) has no *.jsonl files"
                + (f" ({', '.join(folders)}: a directory, not a file)" if folders else ""),
                help=f"point data.{split}.path at a .jsonl file or a directory of them",
            )
        )
    context = _Context(split, template, template_fields(template), num_frames)
    rows: list[JsonlRow] = []
    problems: list[Diagnostic] = []
    for file in files:
        root = Path(image_root) if image_root is not None else file.parent
        for number, text, problem in bounded_lines(file):
            if len(rows) >= num_samples or len(problems) >= MAX_SCANNED_PROBLEMS:
                break
            if problem is not None:
                problems.append(
                    Diagnostic(
                        "data.jsonl-bad-line",
                        problem,
                        file=str(file),
                        line=number,
                        help=_HELP_LAYOUT,
                    )
                )
            elif text.strip():
                row = _parse_line(text, number, file, root, context, problems)
                if row is not None:
                    rows.append(row)
    if not rows and not problems:
        problems.append(
            Diagnostic(
                "data.jsonl-empty",
                f"JSONL file {path} (data.{split}.path) has no rows",
                file=str(path),
                help=_HELP_LAYOUT,
            )
        )
    if problems:
        raise RlflowError(_capped(problems))
    return rows


def first_rows_problems(data_cfg) -> list[Diagnostic]:
    """The recipe check (rlflow.rules.checks): what the trainer would refuse in the first
    DRY_RUN_ROWS rows of each JSONL split. Login-node safe: no torch, no pixels decoded."""
    return [
        problem
        for split in ("train", "validation")
        for problem in _split_problems(getattr(data_cfg, split), data_cfg, split)
    ]


def _split_problems(split_cfg, data_cfg, split: str) -> list[Diagnostic]:
    """The rows as the dataset reads them, and each image's header (its size: PIL refuses a
    decompression bomb when it opens one)."""
    if split_cfg.kind != "jsonl" or not split_cfg.path or split_cfg.num_samples < 1:
        return []  # no path, no rows asked for: the recipe's own rules say so
    try:
        template_fields(data_cfg.prompt_template)
    except ValueError:
        return []  # a broken template: the recipe's template rule says so
    try:
        rows = read_rows(
            Path(split_cfg.path),
            split_cfg.image_root,
            min(split_cfg.num_samples, DRY_RUN_ROWS),
            split,
            template=data_cfg.prompt_template,
            num_frames=data_cfg.video.num_frames,
        )
    except RlflowError as err:
        return list(err.diagnostics)
    from PIL import Image, UnidentifiedImageError

    problems = []
    for row in rows:
        for path in row.image_paths:
            try:
                with Image.open(path):
                    pass
            except Image.DecompressionBombError as exc:
                problems.append(_read_error(row, "image", f"image {path} is too large: {exc}"))
            except (OSError, UnidentifiedImageError) as exc:
                problems.append(_read_error(row, "image", f"cannot read image {path}: {exc}"))
    return [d for err in problems for d in err.diagnostics]


@dataclass(frozen=True)
class _Context:
    split: str
    template: str
    template_fields: list[str]
    num_frames: int | None


def _parse_line(
    text: str, number: int, path: Path, root: Path, ctx: _Context, problems: list[Diagnostic]
) -> JsonlRow | None:
    def problem(code: str, message: str, help: str = _HELP_LAYOUT, column: int | None = None):
        problems.append(
            Diagnostic(code, message, file=str(path), line=number, column=column, help=help)
        )

    try:
        record = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        problem(
            "data.jsonl-bad-json", f"line {number} is not valid JSON: {exc.msg}", column=exc.colno
        )
        return None
    except ValueError as exc:  # NaN, Infinity (Python's json accepts them; JSON does not)
        problem("data.jsonl-bad-json", f"line {number} is not valid JSON: {exc}")
        return None
    if not isinstance(record, dict):
        problem(
            "data.jsonl-bad-row", f"line {number} is a JSON {type(record).__name__}, not an object"
        )
        return None
    question_key = next((k for k in QUESTION_KEYS if k in record), None)
    answer_key = next((k for k in ANSWER_KEYS if k in record), None)
    missing = [
        name for name, key in (("problem", question_key), ("solution", answer_key)) if key is None
    ]
    if missing:
        keys = ", ".join(f"`{k}`" for k in missing)
        alternatives = {"problem": "`question` or `prompt`", "solution": "`answer`"}
        problem(
            "data.jsonl-missing-key",
            f"line {number} has no {keys} (it has: {', '.join(sorted(record)) or 'nothing'})",
            help=_HELP_LAYOUT
            + "; also accepted: "
            + "; ".join(f"{alternatives[m]} for `{m}`" for m in missing),
        )
        return None
    return _check_values(record, question_key, answer_key, number, path, root, ctx, problem)


def _refuse_constant(name: str):
    raise ValueError(f"`{name}` is not a JSON value: write a number or a string")


def _check_values(
    record: dict, question_key: str, answer_key: str, number, path, root, ctx, problem
) -> JsonlRow | None:
    question, solution = record[question_key], record[answer_key]
    bad = [] if isinstance(question, str) and question.strip() else [question_key]
    if isinstance(solution, bool) or not isinstance(solution, str | int | float):
        bad.append(answer_key)
    if bad:
        problem(
            "data.jsonl-bad-value",
            f"line {number}: {', '.join(f'`{k}`' for k in bad)} must be a non-empty string"
            + (f" (or a number for `{answer_key}`)" if answer_key in bad else ""),
        )
        return None
    answer = _answer_from(solution)
    if not answer:
        problem(
            "data.jsonl-bad-value",
            f"line {number}: `{answer_key}` {solution!r} holds no answer",
            help=f'write the answer bare ("3") or tagged ("{format_answer(" 3 ")}")',
        )
        return None
    media = _media_paths(record, number, root, ctx, problem)
    if media is None:
        return None
    image_paths, video = media
    used = {question_key, answer_key, "id", "video", *IMAGE_KEYS}
    extras = {k: v for k, v in record.items() if k not in used}
    question = _MEDIA_MARKER_RE.sub("", question).strip()
    if not question:
        problem(
            "data.jsonl-bad-value",
            f"line {number}: `{question_key}` holds only <image>/<video> markers, no question",
            help="write the question; the chat template places the image or video itself",
        )
        return None
    missing = [f for f in ctx.template_fields if f != "question" and f not in extras]
    if missing:
        problem(
            "data.jsonl-missing-key",
            f"line {number}: data.prompt_template uses {{{missing[0]}}}, but the row has no "
            f"`{missing[0]}` column",
            help=f"add `{missing[0]}` to every row, or change data.prompt_template "
            f"(now {ctx.template!r})",
        )
        return None
    question = render_question(ctx.template, question, extras)
    row_id = str(record.get("id", f"{path.name}:{number}"))
    return JsonlRow(
        id=row_id,
        file=path,
        line=number,
        question=question,
        answer=answer,
        image_paths=image_paths,
        video=video,
        fields=extras,
    )


def _media_paths(record: dict, number: int, root: Path, ctx: _Context, problem):
    """(image paths, video) of a row, every file checked to exist; None after a problem."""
    image_key = next((k for k in IMAGE_KEYS if k in record), None)
    if image_key is not None and "video" in record:
        problem(
            "data.jsonl-bad-row",
            f"line {number} has both `{image_key}` and `video`",
            help="a row shows images or one video, not both",
        )
        return None
    images: tuple[Path, ...] = ()
    if image_key is not None:
        values = _path_list(record[image_key])
        if values is None:
            problem(
                "data.jsonl-bad-value",
                f"line {number}: `{image_key}` must be a path or a list of paths",
            )
            return None
        images = tuple(root / v for v in values)  # an absolute path replaces the root
        for image in images:
            if not image.is_file():
                problem(
                    "data.jsonl-missing-image",
                    f"line {number}: `{image_key}` {image} does not exist",
                    help=f"set data.{ctx.split}.image_root to the directory the image paths "
                    f"start from (now {root})",
                )
                return None
    video = None
    if "video" in record:
        video = _video_path(record["video"], number, root, ctx, problem)
        if video is None:
            return None
    return images, video


def _video_path(value, number: int, root: Path, ctx: _Context, problem):
    if not ctx.num_frames:
        problem(
            "data.jsonl-video-frames",
            f"line {number} has a `video`, but data.video.num_frames is not set",
            help="set data.video.num_frames (e.g. 4), temporal_patch_size (2) and fps",
        )
        return None
    values = _path_list(value)
    if values is None:
        problem(
            "data.jsonl-bad-value",
            f"line {number}: `video` must be a path (a file or a directory of frames) or a list "
            "of frame paths",
        )
        return None
    paths = tuple(root / v for v in values)
    missing = [p for p in paths if not p.exists()]
    if missing:
        problem(
            "data.jsonl-missing-video",
            f"line {number}: `video` {missing[0]} does not exist",
            help=f"set data.{ctx.split}.image_root to the directory the media paths start "
            f"from (now {root})",
        )
        return None
    if isinstance(value, list):
        return paths
    return paths[0]


def _path_list(value) -> list[str] | None:
    if isinstance(value, str) and value.strip():
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) and v.strip() for v in value):
        return value
    return None


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
    return problems[: MAX_REPORTED - 1] + [last.replace(notes=(*last.notes, note))]
