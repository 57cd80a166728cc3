"""A checked chat request -> the Prompt the engine prefills, with the ids the trainer would build.

The checkpoint's own processor does everything, exactly as rlflow/model/processor.py does for
training samples: its chat template renders the conversation (and the tools), the processor
expands each image into its pad tokens and makes the pixel patches. So `prompt_token_ids` in a
response are the ids a trainer builds for the same conversation. A request that sends an earlier
assistant turn's ids back gets them continued instead of its text re-rendered (continuity.py).
"""

from __future__ import annotations

import collections
import functools
import json
import threading
import uuid
from pathlib import Path

from rlflow.model.media import Media, Prompt
from rlflow.model.processor import CheckpointProcessor
from rlflow.serve.chat import ApiError, ChatRequest, decode_image
from rlflow.serve.continuity import continue_ids
from rlflow.serve.tools import arguments_as_objects


class ChatEncoder(CheckpointProcessor):
    def __init__(self, checkpoint: Path):
        super().__init__(checkpoint)
        self.checkpoint = Path(checkpoint)

    def encode(self, chat: ChatRequest) -> Prompt:
        """The conversation, templated with a generation prompt, tokenized with its images."""
        if (chat.images or chat.videos) and not self.multimodal:
            raise ApiError(400, "this model is text-only: send no images or videos", "messages")
        messages = arguments_as_objects(chat.messages)
        template = self.processor if self.multimodal else self.tokenizer
        kwargs = dict(chat.chat_template_kwargs)
        if chat.tools:
            kwargs["tools"] = chat.tools
        try:
            text = template.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as exc:  # the checkpoint's Jinja template refused the conversation
            raise ApiError(400, f"the chat template cannot render these messages: {exc}",
                           "messages") from None  # fmt: skip
        if chat.tools and text == template.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **chat.chat_template_kwargs
        ):
            raise ApiError(
                400, "this checkpoint's chat template does not render `tools`: the model would "
                "never see them", "tools", "unsupported",
            )  # fmt: skip
        if not self.multimodal:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = self._continued(chat, messages, kwargs, ids)
            return Prompt(f"chat-{uuid.uuid4().hex}", text, tuple(ids), Media())
        decoded = [decode_image(url, where) for url, where in chat.images]
        media_kwargs = _media_kwargs(decoded, chat.videos)
        try:
            enc = self.processor(text=[text], return_tensors="pt", **media_kwargs)
        except Exception as exc:  # e.g. an image too small for the processor
            raise ApiError(400, f"the processor cannot take these images or videos: {exc}",
                           "messages", "invalid_image") from None  # fmt: skip
        media = Media(
            pixel_values=enc.get("pixel_values"),
            image_grid_thw=enc.get("image_grid_thw"),
            pixel_values_videos=enc.get("pixel_values_videos"),
            video_grid_thw=enc.get("video_grid_thw"),
            second_per_grid_ts=enc.get("second_per_grid_ts"),
        )
        ids = tuple(self._continued(chat, messages, kwargs, enc["input_ids"][0].tolist()))
        video = chat.videos[0] if len(chat.videos) == 1 else None  # (vLLM-style backends: one)
        return Prompt(
            f"chat-{uuid.uuid4().hex}", text, ids, media, images=tuple(decoded),
            video=tuple(video.frames) if video else None, video_fps=video.fps if video else None,
        )  # fmt: skip

    def _continued(self, chat: ChatRequest, messages: list, kwargs: dict, ids: list) -> list:
        """The prompt ids: the template's, or, when the request sent the last assistant turn's
        ids back, those ids continued by the template's ids after that turn (continuity.py)."""
        if chat.continues is None:
            return ids
        template = self.processor if self.multimodal else self.tokenizer
        upto = template.apply_chat_template(
            messages[: chat.continues.message + 1], add_generation_prompt=False, tokenize=False,
            **kwargs,
        )  # fmt: skip
        upto_ids = self.tokenizer(upto, add_special_tokens=False)["input_ids"]
        pads = tuple(
            t for t in (getattr(self.processor, f"{kind}_token_id", None)
                        for kind in ("image", "video")) if t is not None
        ) if self.multimodal else ()  # fmt: skip
        ids = continue_ids(chat.continues, ids, upto_ids, self.eos_token_id, pads)
        vocab = self.vocab_size
        if vocab and max(ids) >= vocab:
            where = f"messages[{chat.continues.message}]"
            raise ApiError(400, f"token id {max(ids)} is past the model's vocabulary of {vocab}",
                           where, "discontinuous_tokens")  # fmt: skip
        return ids

    @functools.cached_property
    def vocab_size(self) -> int | None:
        """The model's vocabulary (its embedding rows, from config.json; None if unnamed)."""
        config = json.loads((self.checkpoint / "config.json").read_text())
        text = config.get("text_config") or {}
        return config.get("vocab_size") or text.get("vocab_size")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _media_kwargs(images: list, videos: list) -> dict:
    """The processor's arguments for the request's images and videos: frames as given (no
    sampling), with their rate, exactly as the trainer's PromptEncoder passes a video sample."""
    kwargs: dict = {}
    if images:
        kwargs["images"] = list(images)
    if videos:
        kwargs["videos"] = [list(v.frames) for v in videos]
        kwargs["video_metadata"] = [
            {"fps": v.fps, "total_num_frames": len(v.frames),
             "frames_indices": list(range(len(v.frames))), "duration": len(v.frames) / v.fps}
            for v in videos
        ]  # fmt: skip
        kwargs["do_sample_frames"] = False
    return kwargs


class PromptCache:
    """Encoded prompts by request content (messages, images, tools, template arguments).

    RL clients send a prompt's G samples as G requests of the same conversation: each is
    encoded once (the chat template and the image processor are the server's costliest host
    work), and identical requests get one shared `Prompt`, which the engine prefills once
    (rlflow/serve/batch.py, `prompt_key`). A request whose twin is being encoded waits for it.
    Holds the last `size` prompts; failures are not kept (the next twin tries again)."""

    def __init__(self, encode, size: int):
        self._encode, self._size = encode, size
        self._done: collections.OrderedDict[tuple, Prompt] = collections.OrderedDict()
        self._running: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()
        self.hits = 0

    def peek(self, chat: ChatRequest) -> Prompt | None:
        """The cached prompt of this content, or None (not encoded yet, or being encoded):
        cheap, never waits, so the event loop can ask before it hands a request over."""
        if chat.videos:
            return None
        key = _content_key(chat)
        with self._lock:
            prompt = self._done.get(key)
            if prompt is not None:
                self._done.move_to_end(key)
                self.hits += 1
            return prompt

    def get(self, chat: ChatRequest) -> Prompt:
        if chat.videos:  # decoded in the request's checks: no content key for them yet
            return self._encode(chat)
        key = _content_key(chat)
        while True:
            with self._lock:
                if key in self._done:
                    self._done.move_to_end(key)
                    self.hits += 1
                    return self._done[key]
                running = self._running.get(key)
                if running is None:
                    running = self._running[key] = threading.Event()
                    break
            running.wait()  # its twin's prompt is cached now (or its encoding failed)
        try:
            prompt = self._encode(chat)
            with self._lock:
                self._done[key] = prompt
                while len(self._done) > self._size:
                    self._done.popitem(last=False)
            return prompt
        finally:
            with self._lock:
                del self._running[key]
            running.set()

    def clear(self) -> None:
        with self._lock:
            self._done.clear()


def _content_key(chat: ChatRequest) -> tuple:
    return (
        _frozen(chat.messages),
        chat.continues,
        tuple(url for url, _ in chat.images),
        _frozen(chat.tools),
        _frozen(chat.chat_template_kwargs),
    )


def _frozen(value):
    """JSON values -> a hashable equivalent (objects as sorted key/value tuples)."""
    if isinstance(value, dict):
        return ("{", *sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return ("[", *(_frozen(v) for v in value))
    return value
