"""Sample -> chat messages (Qwen2.5-VL content-list form) and the supervised target text."""

from __future__ import annotations

from rlflow.data.sample import Sample


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
    return f"<answer>{sample.answer}</answer>"
