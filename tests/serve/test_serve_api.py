"""The server through the official `openai` client, over real HTTP: text, images, tool turns,
logprobs as token ids equal to the engine's, the prompt ids the trainer builds, and the errors."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import httpx
import openai
import pytest

from rlflow.generation.base import SamplingParams
from tests.serve.conftest import MODEL
from tests.tiny import base_recipe, make_prompt, megatron_generation, random_image


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _create(client, **kwargs):
    """(the completion, its weight-version header)."""
    raw = client.chat.completions.with_raw_response.create(model=MODEL, **kwargs)
    return raw.parse(), raw.headers["x-rlflow-weight-version"]


def test_logprobs_as_token_ids_are_the_engines_tokens(client, tiny_policy, tiny_processor):
    question = "How many red squares are there?"
    completion, version = _create(
        client, messages=[{"role": "user", "content": question}], max_tokens=10, seed=11,
        temperature=1.0, logprobs=True, top_logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    choice = completion.choices[0]
    tokens = [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
    logprobs = [t.logprob for t in choice.logprobs.content]
    # the same conversation through generate(), row 0 of a call with the same seed
    prompt = make_prompt(tiny_processor, "text", question)
    eos = tiny_processor.tokenizer.eos_token_id
    [expected] = megatron_generation(tiny_policy, 0).generate(
        [prompt], SamplingParams(10, 1.0, 1.0, 0, 11, (eos,), False)
    )
    assert tokens == expected.token_ids
    assert max(abs(a - b) for a, b in zip(logprobs, expected.logprobs)) < 1e-4
    extra = choice.message.model_extra
    assert extra["prompt_token_ids"] == list(prompt.token_ids)
    assert extra["generation_token_ids"] == tokens
    assert choice.finish_reason == ("stop" if tokens[-1] == eos else "length")
    assert completion.usage.completion_tokens == len(tokens)
    assert int(version) == completion.model_extra["weight_version"] >= 0


def test_an_image_prompt_has_the_ids_the_trainer_builds(client, tiny_ckpt):
    """A CLEVR-style sample through the trainer's PromptEncoder, and the same conversation
    (the image as a PNG data URL) through the server: the same ids; n=2 samples differ."""
    from rlflow.data.sample import Sample
    from rlflow.model.processor import PromptEncoder

    data_cfg = base_recipe().data
    image = random_image(3)
    sample = Sample(id="s", media="image", question="How many cubes?", answer="2", images=(image,))
    trainer = PromptEncoder(tiny_ckpt, data_cfg).encode(sample)
    content = [
        {"type": "image_url", "image_url": {"url": _data_url(image)}},
        {"type": "text", "text": sample.question + data_cfg.prompt_suffix},
    ]
    completion, _ = _create(
        client, messages=[{"role": "user", "content": content}], max_tokens=6, n=2, seed=4
    )
    assert len(completion.choices) == 2
    for choice in completion.choices:
        assert choice.message.model_extra["prompt_token_ids"] == list(trainer.token_ids)
    first, second = (c.message.model_extra["generation_token_ids"] for c in completion.choices)
    assert first != second


def test_a_video_as_frames_or_a_gif_has_the_ids_the_trainer_builds(client, tiny_ckpt):
    """A video sample through the trainer's PromptEncoder (4 frames at 2 fps), and the same
    frames through the server: as a list of PNG data URLs with `fps`, and as a GIF of 500 ms
    frames. The same ids (the GIF's palette changes pixels, never the ids)."""
    from dataclasses import replace

    from rlflow.data.sample import Sample
    from rlflow.model.processor import PromptEncoder

    data_cfg = base_recipe().data
    data_cfg = replace(data_cfg, video=replace(data_cfg.video, num_frames=4,
                                               temporal_patch_size=2, fps=2.0))  # fmt: skip
    frames = tuple(random_image(10 + i, size=56) for i in range(4))
    sample = Sample(id="v", media="video", question="How many?", answer="1", video=frames)
    trainer = PromptEncoder(tiny_ckpt, data_cfg).encode(sample)
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=500)
    gif_url = "data:image/gif;base64," + base64.b64encode(gif.getvalue()).decode()
    text = {"type": "text", "text": sample.question + data_cfg.prompt_suffix}
    for video in (
        {"url": [_data_url(f) for f in frames], "fps": 2.0},
        {"url": gif_url},
    ):
        content = [{"type": "video_url", "video_url": video}, text]
        completion, _ = _create(
            client, messages=[{"role": "user", "content": content}], max_tokens=3, seed=1
        )
        ids = completion.choices[0].message.model_extra["prompt_token_ids"]
        assert ids == list(trainer.token_ids)


def test_identical_requests_are_encoded_once_and_draw_alike(client, server):
    """Two identical image requests at once (a GRPO prompt's samples sent as separate
    requests): one encoding, the same prompt ids; greedy, the same tokens."""
    from concurrent.futures import ThreadPoolExecutor

    content = [
        {"type": "image_url", "image_url": {"url": _data_url(random_image(5))}},
        {"type": "text", "text": "How many spheres?"},
    ]
    prompts = server.served.prompts
    hits = prompts.hits

    def one(_):
        completion, _ = _create(
            client, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0
        )
        return completion.choices[0].message.model_extra

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(one, range(2))
    assert prompts.hits == hits + 1
    assert first["prompt_token_ids"] == second["prompt_token_ids"]
    assert first["generation_token_ids"] == second["generation_token_ids"]


def test_a_cached_prompt_does_not_queue_behind_the_encoding_thread(client, server):
    """A twin of an encoded request (a GRPO prompt's next sample) is submitted from the event
    loop: it is answered while the encoding thread is busy with something else; and each
    request's path is timed, stage by stage, in order."""
    import threading

    served = server.served
    content = [
        {"type": "image_url", "image_url": {"url": _data_url(random_image(7))}},
        {"type": "text", "text": "How many cubes?"},
    ]
    messages = [{"role": "user", "content": content}]
    first, _ = _create(client, messages=messages, max_tokens=2, seed=3)
    release, busy = threading.Event(), threading.Event()

    def hold():
        busy.set()
        release.wait()

    held = served.encoding.submit(hold)  # the one encoding thread is taken
    busy.wait()
    served.trace = []
    try:
        second, _ = _create(client, messages=messages, max_tokens=2, seed=3)
    finally:
        release.set()
        held.result()
        trace, served.trace = served.trace, None
    ids = [c.choices[0].message.model_extra["generation_token_ids"] for c in (first, second)]
    assert ids[0] == ids[1]
    (times,) = trace
    stages = ["start", "arrived", "parsed", "encoding", "encoded", "submitted", "admitted",
              "first_token", "done", "answered"]  # fmt: skip
    assert list(sorted(times, key=times.get)) == stages


def test_tools_and_tool_turns_render_through_the_chat_template(client, tiny_processor):
    """The request's tools reach the prompt (Qwen's hermes system block), and an earlier call
    and its result render as the template renders them for a trainer."""
    tools = [{"type": "function", "function": {
        "name": "count", "description": "Count objects of a color",
        "parameters": {"type": "object", "properties": {"color": {"type": "string"}}},
    }}]  # fmt: skip
    call = {"id": "call_1", "type": "function",
            "function": {"name": "count", "arguments": json.dumps({"color": "red"})}}  # fmt: skip
    messages = [
        {"role": "user", "content": "How many red cubes?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    completion, _ = _create(client, messages=messages, tools=tools, max_tokens=4, seed=0)
    ids = completion.choices[0].message.model_extra["prompt_token_ids"]
    parsed = dict(call, function={"name": "count", "arguments": {"color": "red"}})
    expected = tiny_processor.apply_chat_template(
        [*messages[:1], dict(messages[1], tool_calls=[parsed]), messages[2]],
        tools=tools, add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    text = tiny_processor.tokenizer.decode(ids)
    assert text == expected
    assert '"name": "count"' in text and "<tool_response>\n3\n</tool_response>" in text


def test_tool_calls_in_a_completion_come_back_in_the_openai_shape():
    from rlflow.serve.tools import parse_tool_calls

    text = (
        'Let me count.\n<tool_call>\n{"name": "count", "arguments": {"color": "red"}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me count."
    assert [c["function"] for c in calls] == [{"name": "count", "arguments": '{"color": "red"}'}]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [],
    )  # fmt: skip


def test_stop_strings_end_the_row_and_are_cut(client):
    ask = dict(messages=[{"role": "user", "content": "Count."}], max_tokens=16, seed=2,
               extra_body={"ignore_eos": True})  # fmt: skip
    free, _ = _create(client, **ask)
    text = free.choices[0].message.content
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    stopped, _ = _create(client, stop=[stop], **ask)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.find(stop)]
    assert len(stopped.choices[0].message.model_extra["generation_token_ids"]) < 16


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{server.url}/health")
    assert health.json()["status"] == "ok"
    assert health.headers["x-rlflow-weight-version"] == str(server.served.engine.weight_version)


HELLO = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        (dict(model="gpt-4o", messages=HELLO), 404, "model"),
        (dict(messages=HELLO, max_tokens=0), 400, "max_tokens"),
        (dict(messages=HELLO, max_tokens=1100), 400, "max_tokens"),
        (dict(messages=[{"role": "user", "content": "red " * 1100}]), 400, "messages"),
        (dict(messages=HELLO, top_logprobs=2, logprobs=True), 400, "top_logprobs"),
        (dict(messages=HELLO, stream=True), 400, "stream"),
        (dict(messages=HELLO, extra_body={"guided_json": {}}), 400, "guided_json"),
        (dict(messages=HELLO, tool_choice="required"), 400, "tool_choice"),
        (dict(messages=HELLO, n=5), 400, "n"),
        (
            dict(messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
            ]}]),
            400, "messages[0].content[0].image_url",
        ),
        (
            dict(messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
            ]}]),
            400, "messages[0].content[0].image_url",
        ),
        (dict(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), 400,
         "messages[0].content[0].type"),
        (
            dict(messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
            ]}]),
            400, "messages[0].content[0].video_url",
        ),
        (
            dict(messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": ["data:image/png;base64,AAAA"]}}
            ]}]),
            400, "messages[0].content[0].video_url.fps",
        ),
        (dict(messages=HELLO, extra_body={"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
         400, "chat_template_kwargs.chat_template"),
    ],
    ids=["unknown-model", "max-tokens-0", "past-context", "prompt-too-long", "top-logprobs",
         "stream", "unknown-field", "tool-choice", "n-over-rows", "bad-image", "image-url",
         "audio", "video-mp4", "frames-without-fps", "own-chat-template"],
)  # fmt: skip
def test_bad_requests_get_an_openai_error_naming_the_field(client, kwargs, status, param):
    kwargs.setdefault("model", MODEL)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**kwargs)
    assert caught.value.status_code == status
    error = caught.value.body
    assert error["param"] == param and error["message"], error


def test_malformed_json_is_a_400_and_the_server_keeps_serving(client, server):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": ')
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    completion, _ = _create(client, messages=HELLO, max_tokens=2)
    assert completion.choices[0].message.content is not None


def test_a_hybrid_model_is_served(hybrid_policy):
    """Tiny Nemotron-H (Mamba-2 + attention + MLP) behind its own server: a request's 2 choices
    (one shared prefill, its Mamba state copied to both rows) are generate()'s rows 0 and 1."""
    from openai import OpenAI

    from rlflow.serve.runner import ServerThread, served_engine
    from tests.serve.conftest import SERVER_KEYS
    from tests.tiny import text_prompt

    policy, tokenizer, path = hybrid_policy
    recipe = base_recipe()
    gen = recipe.generation
    gen = dataclasses.replace(gen, server=dataclasses.replace(gen.server, **SERVER_KEYS))
    served = served_engine(policy, path, dataclasses.replace(recipe, generation=gen), "hybrid")
    thread = ServerThread(served, "127.0.0.1", 0, 8, 30).start()
    try:
        client = OpenAI(base_url=f"{thread.url}/v1", api_key="unused", max_retries=0)
        question = "How many red squares are there?"
        completion = client.chat.completions.create(
            model="hybrid", messages=[{"role": "user", "content": question}], n=2,
            max_tokens=10, seed=3, temperature=1.0, logprobs=True, top_logprobs=0,
            extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
    finally:
        thread.stop()
    prompt = text_prompt(tokenizer, question)
    eos = tokenizer.eos_token_id
    expected = megatron_generation(policy, 0).generate(
        [prompt, prompt], SamplingParams(10, 1.0, 1.0, 0, 3, (eos,), False)
    )
    for choice, row in zip(completion.choices, expected):
        tokens = [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
        assert tokens == row.token_ids
