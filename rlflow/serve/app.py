"""The HTTP side: FastAPI routes of the OpenAI Chat Completions subset on a ServingEngine.

POST /v1/chat/completions, GET /v1/models, GET /health, POST /tokenize (vLLM's: NeMo Gym
asks it when a response carries no prompt ids). Every completion carries the weight version
it was generated with: the `X-Rlflow-Weight-Version` header and the `weight_version` field.
Errors are the OpenAI error shape with a 4xx naming the field (rlflow/serve/chat.py), 503 for a
request refused by a weight update (`generation.server.on_weight_update: refuse`: send it again).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.requests import Request as HttpRequest

from rlflow.generation.base import SamplingParams
from rlflow.generation.megatron.sampling import row_seeds
from rlflow.serve.chat import ApiError, ChatRequest, parse_chat
from rlflow.serve.engine import ServingEngine
from rlflow.serve.prompts import ChatEncoder, PromptCache
from rlflow.serve.requests import Request
from rlflow.serve.tools import parse_tool_calls

VERSION_HEADER = "X-Rlflow-Weight-Version"
# Encoded prompts kept by content (a GRPO prompt's samples arrive as separate requests close
# together; 128 image prompts of Qwen2.5-VL at 448 px hold ~600 MB of pixel patches)
_CACHED_PROMPTS = 128
_REFUSED_STATUS = {
    "weight_update": 503, "step_ended": 503, "engine_error": 500, "cancelled": 499,
}  # fmt: skip


@dataclass
class Served:
    """What the routes need: the engine, the checkpoint's processor and the served name."""

    engine: ServingEngine
    encoder: ChatEncoder
    model_name: str
    default_max_tokens: int  # generation.max_new_tokens, when a request names none
    # seconds spent reading requests: "parse" (body, JSON, images) and "encode" (template,
    # processor), summed over requests (threads overlap): benchmarks read it
    seconds: dict[str, float] = field(default_factory=dict)
    # each answered request's stage times (Request.times), when a list: benchmarks set it
    trace: list[dict[str, float]] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    prompts: PromptCache = field(init=False)  # encoded prompts by request content
    # One thread encodes (template, image processor): many request threads running the
    # processor's torch ops at once (each with every core's intra-op threads) slowed every
    # one of them and the engine's thread by an order of magnitude.
    encoding: concurrent.futures.ThreadPoolExecutor = field(init=False)

    def __post_init__(self):
        self.prompts = PromptCache(self.encoder.encode, _CACHED_PROMPTS)
        self.encoding = concurrent.futures.ThreadPoolExecutor(1, "rlflow-serve-encode")

    async def encode(self, function, *args):
        """function(*args) in the encoding thread."""
        return await asyncio.get_running_loop().run_in_executor(self.encoding, function, *args)

    def close(self) -> None:
        self.engine.close()
        self.encoding.shutdown(wait=False, cancel_futures=True)

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @property
    def context_tokens(self) -> int:
        return self.engine.context_tokens

    def submit(self, chat: ChatRequest, times: dict[str, float], on_done, prompt=None):
        """Encode a checked chat request (unless its `prompt` is given: a twin's, from the
        cache) and hand it to the engine -> (engine Request, prompt ids); ApiError when it
        cannot fit. `times`: the request's stage times so far (Request.times); `on_done`:
        Request.on_done. Runs in the encoding thread, which submits a newly encoded request
        itself (no hop back through the busy event loop), or on the loop for a cache hit."""
        start = times["encoding"] = time.perf_counter()
        if prompt is None:
            prompt = self.prompts.get(chat)
        times["encoded"] = time.perf_counter()
        self.add("encode", times["encoded"] - start)
        ids = list(prompt.token_ids)
        room = self.context_tokens - len(ids)
        if room < 1:
            raise ApiError(
                400, f"the prompt is {len(ids)} tokens: this server's context is "
                f"{self.context_tokens} tokens (generation.server.context_tokens)",
                "messages", "context_length_exceeded",
            )  # fmt: skip
        max_tokens = chat.max_tokens or min(self.default_max_tokens, room)
        if max_tokens > room:
            raise ApiError(
                400, f"max_tokens={max_tokens} and the {len(ids)}-token prompt exceed this "
                f"server's context of {self.context_tokens} tokens: ask at most {room}",
                "max_tokens", "context_length_exceeded",
            )  # fmt: skip
        seed = chat.seed if chat.seed is not None else secrets.randbits(31)
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=chat.temperature, top_p=chat.top_p,
            top_k=chat.top_k, seed=seed,
            stop_token_ids=(self.encoder.eos_token_id, *chat.stop_token_ids),
            ignore_eos=chat.ignore_eos,
        )  # fmt: skip
        seeds = row_seeds(seed, chat.n, "cpu").tolist()
        stop_check = _stop_check(self.encoder, chat.stop) if chat.stop else None
        request = Request(
            prompt, ids, params, seeds, stop_check=stop_check, on_done=on_done, times=times
        )
        times["submitted"] = time.perf_counter()
        self.engine.submit(request)
        return request, ids


def make_app(served: Served) -> FastAPI:
    app = FastAPI(title="rlflow", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health():
        engine = served.engine
        body = {"status": "ok", "weight_version": engine.weight_version, "error": engine.error}
        return JSONResponse(body, headers={VERSION_HEADER: str(engine.weight_version)})

    @app.get("/v1/models")
    async def models():
        card = {"id": served.model_name, "object": "model", "created": 0, "owned_by": "rlflow",
                "max_model_len": served.context_tokens}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(http_request: HttpRequest):
        body = await _json(http_request)
        body = {k: v for k, v in body.items() if k in ("model", "messages", "tools",
                                                       "chat_template_kwargs")}  # fmt: skip
        chat = parse_chat(body, served.model_name)
        prompt = await served.encode(served.prompts.get, chat)
        ids = list(prompt.token_ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": served.context_tokens}

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: HttpRequest):
        # the raw request: its body is parsed here, so a malformed one is a 400 in the OpenAI
        # shape (not FastAPI's 422)
        times = {"start": time.perf_counter()}  # the request path's stages (Request.times)
        body = await _json(http_request)
        times["arrived"] = time.perf_counter()  # its whole body received and read as JSON
        chat = parse_chat(body, served.model_name)
        times["parsed"] = time.perf_counter()
        served.add("parse", times["parsed"] - times["arrived"])
        if chat.n > served.engine.max_rows:
            raise ApiError(400, f"`n`={chat.n}: this server runs at most "
                           f"{served.engine.max_rows} rows (generation.server.max_rows)", "n")  # fmt: skip
        loop = asyncio.get_running_loop()
        finished = loop.create_future()

        def on_done(_request):  # (the engine's thread)
            loop.call_soon_threadsafe(_settle, finished)

        # A twin's prompt (a GRPO prompt's other samples) is looked up here: no thread hop.
        prompt = served.prompts.peek(chat)
        if prompt is not None:
            request, ids = served.submit(chat, times, on_done, prompt)
        else:
            request, ids = await served.encode(served.submit, chat, times, on_done)
        await _wait(served.engine, request, finished, http_request)
        if request.error is not None:
            status = _REFUSED_STATUS.get(request.error.kind, 500)
            raise ApiError(status, str(request.error), None, request.error.kind)
        body = _completion(served, chat, request, ids)
        if served.trace is not None:
            times["answered"] = time.perf_counter()
            served.trace.append(times)
        return JSONResponse(body, headers={VERSION_HEADER: str(request.weight_version)})

    return app


async def _json(http_request) -> dict:
    raw = await http_request.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(
            400, f"the request body is not valid JSON: {exc}", None, "invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def _wait(engine: ServingEngine, request: Request, finished, http_request) -> None:
    """Wait for a submitted request (`finished`: settled by its on_done); a client that
    disconnects meanwhile has its rows freed at once."""

    async def watch():
        while (await http_request.receive())["type"] != "http.disconnect":
            pass
        engine.cancel(request)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait([finished, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not request.done:
            engine.cancel(request)


def _settle(future) -> None:
    if not future.done():
        future.set_result(None)


def _completion(served: Served, chat: ChatRequest, request: Request, ids: list[int]) -> dict:
    encoder = served.encoder
    choices, generated = [], 0
    for index, choice in enumerate(request.choices):
        generated += len(choice.token_ids)
        text = _cut_at_stop(encoder.decode(choice.token_ids), chat.stop)
        content, calls = parse_tool_calls(text) if chat.parse_tools else (text, [])
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        message.update(
            prompt_token_ids=ids,
            generation_token_ids=choice.token_ids,
            generation_log_probs=choice.logprobs,
        )
        logprobs = None
        if chat.logprobs:
            logprobs = {"content": [
                _token_logprob(encoder, t, lp, chat.tokens_as_ids)
                for t, lp in zip(choice.token_ids, choice.logprobs)
            ]}  # fmt: skip
        reason = "tool_calls" if calls else choice.finish_reason
        choices.append(
            {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
        )
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served.model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(ids),
            "completion_tokens": generated,
            "total_tokens": len(ids) + generated,
        },
        "weight_version": request.weight_version,
    }
    if request.superseded:
        body["weight_version_superseded"] = True  # newer weights came while it ran
    return body


def _token_logprob(encoder: ChatEncoder, token: int, logprob: float, as_id: bool) -> dict:
    text = f"token_id:{token}" if as_id else encoder.token_text(token)
    return {
        "token": text,
        "logprob": logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [],
    }


def _cut_at_stop(text: str, stops: list[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def _stop_check(encoder: ChatEncoder, stops: list[str]):
    """A stop-string test on a row's tokens: decodes only the tail a new stop could end in."""
    tail = max(len(s) for s in stops) + 4  # tokens: at least a character each, plus margin

    def stopped(token_ids: list[int]) -> bool:
        text = encoder.decode(token_ids[-tail:])
        return any(s in text for s in stops)

    return stopped
