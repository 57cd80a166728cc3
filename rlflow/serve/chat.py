"""A Chat Completions request body, checked: what rlflow serves, and a 400 naming anything else.

The subset (docs/serve.md) is what RL environments send: messages with text and images (data
URLs), tools, stop, max_tokens, temperature, top_p, seed, n, logprobs (top_logprobs 0), and
vLLM's extensions of the same names (`return_tokens_as_token_ids`, `top_k`, `ignore_eos`,
`stop_token_ids`, `chat_template_kwargs`). A field outside it, or a value rlflow does not implement (streaming,
top_logprobs > 0, penalties, ...), is refused with the OpenAI error shape, naming the field:
never silently ignored.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from typing import Any

# Fields the server reads. `user` and `metadata` are the client's labels (OpenAI stores them).
_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "stop", "n", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "stream", "return_tokens_as_token_ids", "user", "metadata",
    "chat_template_kwargs", "ignore_eos", "frequency_penalty", "presence_penalty",
    "stop_token_ids",
}  # fmt: skip
# Fields accepted only at the value that changes nothing.
_ONLY = {
    "stream": (False, "streaming is not implemented: send stream=false"),
    "frequency_penalty": (0, "penalties are not implemented: send 0 or leave it out"),
    "presence_penalty": (0, "penalties are not implemented: send 0 or leave it out"),
}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
# Token information NeMo Gym sends back on earlier assistant turns (its training messages).
_TOKEN_INFO = {"prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts"}
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"} | _TOKEN_INFO


@dataclass(frozen=True)
class Continuation:
    """The token ids a client sent back on its last assistant turn (NeMo Gym's `vllm_model`
    does, as vLLM's NeMo RL server reads them): the new prompt continues them exactly
    (rlflow/serve/continuity.py)."""

    message: int  # the index of the last assistant message that carries them
    prompt_ids: tuple[int, ...]  # its `prompt_token_ids`
    generated_ids: tuple[int, ...]  # its `generation_token_ids`


class ApiError(Exception):
    """An HTTP error in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or ("invalid_request" if status < 500 else "server_error")

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 404:
            kind = "not_found_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error, "object": "error"}


@dataclass(frozen=True)
class Video:
    """A `video_url` content part, decoded: its frames (RGB PIL images) and their rate."""

    frames: list
    fps: float


@dataclass
class ChatRequest:
    """A checked request: the conversation for the chat template, its images, the sampling."""

    messages: list[dict]  # content parts as the chat templates take them ({"type": "image"})
    continues: Continuation | None = None  # the last assistant turn's ids, when sent back
    # its images' data URLs, in order, each with where it was (`messages[0].content[1]...`):
    # decoded by the encoder (rlflow/serve/prompts.py), off the event loop, once per content
    images: list[tuple[str, str]] = field(default_factory=list)
    videos: list[Video] = field(default_factory=list)  # decoded videos, in order
    tools: list[dict] | None = None
    parse_tools: bool = False
    chat_template_kwargs: dict = field(default_factory=dict)
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: beside end-of-turn
    ignore_eos: bool = False
    logprobs: bool = False
    tokens_as_ids: bool = False


def parse_chat(body: Any, model_name: str) -> ChatRequest:
    """The request body (parsed JSON) -> ChatRequest, or ApiError naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key in body:
        if key not in _FIELDS:
            raise ApiError(400, f"`{key}` is not supported by rlflow's server", key, "unsupported")
    for key, (value, why) in _ONLY.items():
        if body.get(key) not in (None, value):
            raise ApiError(400, f"`{key}`={body[key]!r}: {why}", key, "unsupported")
    model = body.get("model")
    if model != model_name:
        raise ApiError(
            404, f"model `{model}` is not served here; this server serves `{model_name}`",
            "model", "model_not_found",
        )  # fmt: skip
    chat = ChatRequest(messages=[])
    chat.messages, chat.images, chat.videos = _messages(body.get("messages"))
    chat.continues = continuation(body["messages"])
    _sampling(body, chat)
    _tools(body, chat)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "`chat_template_kwargs` must be an object", "chat_template_kwargs")
    for key in kwargs:
        if key in _TEMPLATE_CALL_ARGUMENTS:  # the server's own call, not a template variable
            raise ApiError(400, f"`chat_template_kwargs.{key}` is set by the server, not the "
                           "request: send only the template's own variables (e.g. "
                           "enable_thinking)", f"chat_template_kwargs.{key}")  # fmt: skip
    chat.chat_template_kwargs = kwargs
    return chat


# apply_chat_template's own arguments: the checkpoint's template, the tools and the generation
# prompt are the server's to set, so the ids stay the ones the trainer builds.
_TEMPLATE_CALL_ARGUMENTS = frozenset((
    "chat_template", "tokenize", "add_generation_prompt", "continue_final_message", "tools",
    "documents", "conversation", "return_tensors", "return_dict", "padding", "truncation",
    "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
))  # fmt: skip


def _sampling(body: dict, chat: ChatRequest) -> None:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        chat.max_tokens = _int(body, name, 1)
    if body.get("n") is not None:
        chat.n = _int(body, "n", 1)
    if body.get("temperature") is not None:
        chat.temperature = _number(body, "temperature", 0.0, 2.0)
    if body.get("top_p") is not None:
        chat.top_p = _number(body, "top_p", 0.0, 1.0)
        if chat.top_p == 0:
            raise ApiError(400, "`top_p` must be greater than 0", "top_p")
    if body.get("top_k") not in (None, -1):
        chat.top_k = _int(body, "top_k", 0)
    if body.get("seed") is not None:
        chat.seed = _int(body, "seed", -(2**63))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (
        isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
    ):
        raise ApiError(400, "`stop` must be a non-empty string or a list of them", "stop")
    chat.stop = stop or []
    ids = body.get("stop_token_ids") or []
    if not (isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)):
        raise ApiError(400, "`stop_token_ids` must be a list of token ids", "stop_token_ids")
    chat.stop_token_ids = ids
    chat.ignore_eos = _bool(body, "ignore_eos")
    chat.logprobs = _bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise ApiError(
            400, f"`top_logprobs`={top!r}: only 0 is implemented (each token's own logprob)",
            "top_logprobs", "unsupported",
        )  # fmt: skip
    chat.tokens_as_ids = _bool(body, "return_tokens_as_token_ids")


def _tools(body: dict, chat: ChatRequest) -> None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(
            400, f"`tool_choice`={choice!r}: only \"auto\" and \"none\" are implemented",
            "tool_choice", "unsupported",
        )  # fmt: skip
    if not tools:
        return
    if not isinstance(tools, list):
        raise ApiError(400, "`tools` must be a list", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise ApiError(400, "a tool must be {\"type\": \"function\", \"function\": {...}}",
                           f"tools[{i}]")  # fmt: skip
        if not isinstance(function.get("name"), str):
            raise ApiError(400, "a function needs a string `name`", f"tools[{i}].function.name")
    chat.tools = tools
    chat.parse_tools = choice != "none"


def _messages(messages) -> tuple[list[dict], list, list[Video]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list", "messages")
    out, images, videos = [], [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ApiError(400, f"a message needs a role, one of {sorted(_ROLES)}", where)
        for key in message:
            if key not in _MESSAGE_KEYS:
                raise ApiError(400, f"`{key}` is not supported in a message", f"{where}.{key}")
        converted = {k: v for k, v in message.items() if k not in _TOKEN_INFO}
        content = message.get("content")
        if isinstance(content, list):
            converted["content"] = [
                _part(part, f"{where}.content[{j}]", images, videos)
                for j, part in enumerate(content)
            ]
        elif content is None and not message.get("tool_calls"):
            raise ApiError(400, "a message needs `content`", f"{where}.content")
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, "`content` must be a string or a list of parts", f"{where}.content")
        out.append(converted)
    return out, images, videos


def continuation(messages: list[dict]) -> Continuation | None:
    """The last assistant turn's `prompt_token_ids` + `generation_token_ids`, checked; None when
    no message carries them. Every assistant turn after the first one that carries ids must carry
    them too: a turn without would be re-tokenized from its decoded text."""
    found, first = None, None
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        has = [key for key in ("prompt_token_ids", "generation_token_ids") if key in message]
        if has and message["role"] != "assistant":
            raise ApiError(400, "token ids are read on assistant turns only", f"{where}.{has[0]}")
        if message["role"] != "assistant" or (not has and first is None):
            continue
        if len(has) < 2:
            missing = "generation_token_ids" if has else "prompt_token_ids"
            sent = f"messages[{first}]" if first is not None else "an earlier assistant turn"
            raise ApiError(
                400, f"`{missing}` is missing: {sent} carries its token ids, so every later "
                "assistant turn must carry `prompt_token_ids` and `generation_token_ids` (a turn "
                "without would be re-tokenized from its text)", f"{where}.{missing}",
                "discontinuous_tokens",
            )  # fmt: skip
        first = i if first is None else first
        prompt = _token_ids(message["prompt_token_ids"], f"{where}.prompt_token_ids")
        generated = _token_ids(message["generation_token_ids"], f"{where}.generation_token_ids")
        if not prompt:
            raise ApiError(400, "`prompt_token_ids` is empty", f"{where}.prompt_token_ids")
        found = Continuation(i, prompt, generated)
    return found


def _token_ids(value, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise ApiError(400, "must be a list of token ids (integers >= 0)", where)
    return tuple(value)


def _part(part, where: str, images: list, videos: list) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        where = f"{where}.image_url"
        if not isinstance(url, str) or not url.startswith("data:"):
            raise ApiError(400, "images must be data URLs (data:image/png;base64,...)", where)
        images.append((url, where))
        return {"type": "image"}
    if kind == "video_url":
        videos.append(decode_video(part.get("video_url"), f"{where}.video_url"))
        return {"type": "video"}
    raise ApiError(
        400, f"content part type {kind!r} is not supported: send \"text\", \"image_url\" or "
        "\"video_url\"",
        f"{where}.type", "unsupported",
    )  # fmt: skip


def decode_image(url, where: str):
    """A `data:image/...;base64,` URL -> an RGB PIL image (the server downloads nothing)."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(url, str) or not url.startswith("data:"):
        raise ApiError(400, "images must be data URLs (data:image/png;base64,...)", where)
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ApiError(400, "an image data URL must be base64 (data:image/png;base64,...)", where)
    try:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as exc:
        raise ApiError(400, f"the image does not decode: {exc}", where, "invalid_image") from None
    return image.convert("RGB")


def decode_video(spec, where: str) -> Video:
    """A `video_url` part's object -> its frames: {"url": [frame data URLs...], "fps": F}, or
    {"url": "data:image/gif;base64,..."} (the GIF's frames at its own rate, or "fps" if given).
    Video files (mp4, webm, ...) are refused: the server decodes no video codecs."""
    if not isinstance(spec, dict):
        raise ApiError(400, "`video_url` must be an object with a `url`", where)
    url, fps = spec.get("url"), spec.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or fps <= 0):
        raise ApiError(400, f"`fps`={fps!r}: must be a number > 0", f"{where}.fps")
    if isinstance(url, list):
        if not url:
            raise ApiError(400, "a video needs at least one frame", f"{where}.url")
        if fps is None:
            raise ApiError(
                400, "a video sent as frames needs its frame rate, `fps`", f"{where}.fps"
            )
        frames = [decode_image(u, f"{where}.url[{i}]") for i, u in enumerate(url)]
        return Video(frames, float(fps))
    if isinstance(url, str) and url.startswith("data:image/gif;"):
        return _gif(url, fps, where)
    kind = url.partition(";")[0].removeprefix("data:") if isinstance(url, str) else type(url)
    raise ApiError(
        400, f"a video as {kind!r} is not decoded by rlflow's server: send its frames (a list "
        "of image data URLs, with `fps`) or a GIF data URL", where, "unsupported",
    )  # fmt: skip


def _gif(url: str, fps, where: str) -> Video:
    from PIL import Image, ImageSequence, UnidentifiedImageError

    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ApiError(400, "a GIF data URL must be base64 (data:image/gif;base64,...)", where)
    try:
        gif = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        frames = [frame.convert("RGB") for frame in ImageSequence.Iterator(gif)]
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as exc:
        raise ApiError(400, f"the GIF does not decode: {exc}", where, "invalid_image") from None
    if fps is None:
        duration_ms = gif.info.get("duration") or 100  # GIF's own frame time (100 ms unset)
        fps = 1000.0 / duration_ms
    return Video(frames, float(fps))


def _int(body: dict, key: str, low: int) -> int:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"`{key}`={value!r}: must be an integer >= {low}", key)
    return value


def _number(body: dict, key: str, low: float, high: float) -> float:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(400, f"`{key}`={value!r}: must be a number in [{low}, {high}]", key)
    return float(value)


def _bool(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"`{key}`={value!r}: must be true or false", key)
    return bool(value)
