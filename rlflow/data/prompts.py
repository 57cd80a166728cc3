"""Sample -> chat messages (Qwen2.5-VL content-list form) and the supervised target text.

The answer format lives here, once: the warm start's target (`format_answer`), the rewards'
parser (`ANSWER_RE`, rlflow.data.rewards), the tiny tokenizer's special tokens and the JSONL
loader's examples all read it. recipes/base.yaml's `data.prompt_suffix` tells the model the
same tags (a test holds the two together).
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping

from rlflow.data.sample import Sample

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
# The text between the tags; rewards read the last such block of a completion.
ANSWER_RE = re.compile(
    f"{re.escape(ANSWER_OPEN)}(.*?){re.escape(ANSWER_CLOSE)}", re.DOTALL | re.IGNORECASE
)


def format_answer(answer: object) -> str:
    """An answer in the format the rewards parse: <answer>3</answer>."""
    return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def to_messages(sample: Sample, prompt_suffix: str) -> list[dict]:
    """One user turn: a media entry per image (or one for the video), then the question.

    Media entries carry no pixels: the processor gets `sample.images` / `sample.video` beside
    the text and expands each entry into that many visual tokens. Text rows get no media entry.
    """
    content: list[dict] = [{"type": "image"} for _ in sample.images]
    if sample.video is not None:
        content.append({"type": "video"})
    content.append({"type": "text", "text": sample.question + prompt_suffix})
    return [{"role": "user", "content": content}]


def reference_completion(sample: Sample) -> str:
    """What a perfect policy answers: the warm start's target and the format reward's model."""
    return format_answer(sample.answer)


def template_fields(template: str) -> list[str]:
    """The {names} a prompt template uses; ValueError for a malformed template.

    Only plain names: no attribute access, indexing, conversions or format specs, so a
    template cannot reach into objects and every name is a JSONL column (or `question`).
    """
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(f"{{{name}}} is not a plain {{column}} placeholder")
        names.append(name)
    return names


def render_question(template: str, question: str, columns: Mapping[str, object]) -> str:
    """The question a JSONL row shows: the template with {question} and the row's columns.

    KeyError names a placeholder the row has no column for (the caller reports file:line).
    """
    values = {name: columns[name] for name in template_fields(template) if name != "question"}
    return template.format(question=question, **values)
