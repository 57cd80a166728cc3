"""One row of data: what the trainer turns into a prompt, and the answer it scores against."""

from __future__ import annotations

from dataclasses import field
from typing import TYPE_CHECKING, Any, Literal

from rlflow.frozen import frozen

if TYPE_CHECKING:  # PIL stays out of the import path of login-node code
    from PIL.Image import Image

    from rlflow.data.scene import Scene

Media = Literal["image", "video", "text"]


@frozen
class Sample:
    """A question with a checkable answer and its media.

    `question` is the user's text without media markers: the chat template places the
    image/video tokens (`rlflow.data.prompts.to_messages`). `video` frames are RGB and all
    the same size. `scene` is the generated scene graph for synthetic rows (None for files):
    tests and per-template metrics read it; the model never sees it. `fields` holds a JSONL
    row's extra columns, passed to rewards (`RewardBatch.fields`).
    """

    id: str
    media: Media
    question: str
    answer: str
    images: tuple[Image, ...] = ()
    video: tuple[Image, ...] | None = None
    kind: str = ""  # the dataset kind that made the row: clevr | video | text | jsonl
    template: str = ""  # question family, e.g. "color_shape" (for per-family accuracy)
    scene: Scene | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # a JSONL row's extra columns (rewards)
