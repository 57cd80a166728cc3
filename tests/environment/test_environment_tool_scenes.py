"""The built-in multi-turn task (environment tool_scenes) on the tiny checkpoint's real tokenizer
and chat template: trajectories continue token for token, a template that re-renders earlier
turns is refused, and malformed tool calls are counted.

The policy's turns here are scripted (`Scripted`, a GenerationBackend that returns given
texts): a random tiny model cannot be made to write a given valid or malformed call. Everything
else (tokenizer, chat template, tool parser, environment) is the real thing; a real engine runs
the task in tests/train/test_train_multiturn.py.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from rlflow.data.scene import SceneSpec, count
from rlflow.data.text import make_text_row
from rlflow.environment.tool_scenes import ToolScenes, call_text, query_of
from rlflow.errors import RlflowError
from rlflow.generation.base import Completion, GenerationBackend, SamplingParams
from rlflow.model.processor import PromptEncoder
from tests.tiny import base_recipe

SUFFIX = " Call count, then answer in <answer></answer> tags."
PARAMS = SamplingParams(16, 1.0, 1.0, 0, 7, (), False)


class Scripted(GenerationBackend):
    """Returns turn k's scripted texts (one per prompt it is given), each ended by the stop
    token, and records every call's prompts."""

    name = "scripted"

    def __init__(self, encoder, turns: list[list[str]]):
        self.encoder, self.turns, self.calls = encoder, turns, []

    def generate(self, prompts, params):
        texts = self.turns[len(self.calls)] if prompts else []
        self.calls.append(list(prompts))
        out = []
        for text in texts:
            ids = self.encoder.completion_ids(text)
            out.append(Completion(ids, [-0.5] * len(ids), "stop"))
        return out


@pytest.fixture(scope="module")
def encoder(tiny_ckpt):
    data = dataclasses.replace(base_recipe().data, prompt_suffix=SUFFIX)
    return PromptEncoder(tiny_ckpt, data)


def rows(n: int):
    rng = random.Random(3)
    spec = SceneSpec(image_size=56, max_objects=3, num_frames=None, condition=None)
    return [make_text_row(rng, f"row{i}", spec) for i in range(n)]


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_turn_prompts_are_the_previous_ids_plus_the_environments(encoder):
    samples = rows(2)
    prompts = [encoder.encode(s) for s in samples]
    calls = [call_text(query_of(s.question), "hermes") for s in samples]
    answers = [f"<answer>{s.answer}</answer>" for s in samples]
    backend = Scripted(encoder, [calls, answers])
    made = ToolScenes(encoder, 2, SUFFIX, 60, "hermes").rollout(backend, prompts, samples, PARAMS)
    for i, (sample, prompt, done) in enumerate(zip(samples, prompts, made.completions)):
        (one, a, b), (zero, _, c), (last, _, d) = runs(done.loss_mask)
        assert (one, zero, last) == (1, 0, 1) and d == len(done.token_ids)
        turn2 = backend.calls[1][i]
        # turn 2's prompt: the prompt's ids, the policy's call, the environment's ids, exactly
        assert list(turn2.token_ids) == list(prompt.token_ids) + done.token_ids[:c]
        assert backend.calls[0][i] is prompt  # turn 1: the prompt itself (shared prefill)
        env_text = encoder.tokenizer.decode(done.token_ids[b:c], skip_special_tokens=False)
        answer = count(sample.scene, query_of(sample.question))
        assert env_text == f"\n<|im_start|>user\n<tool_response>\n{answer}\n</tool_response>" \
            "<|im_end|>\n<|im_start|>assistant\n"  # fmt: skip
        assert done.logprobs[b:c] == [0.0] * (c - b) and done.logprobs[:b] == [-0.5] * b
        # the whole trajectory is the template's rendering of the conversation
        messages = [
            {"role": "user", "content": sample.question + SUFFIX},
            {"role": "assistant", "content": calls[i]},
            {"role": "tool", "content": str(answer)},
            {"role": "assistant", "content": answers[i]},
        ]
        rendered = encoder.processor.apply_chat_template(messages, tokenize=False)
        ids = list(prompt.token_ids) + done.token_ids
        assert rendered == encoder.tokenizer.decode(ids, skip_special_tokens=False) + "\n"
    assert made.reward_texts == answers
    assert made.sums["env/turns"] == 4 and made.sums["env/valid_tool_calls"] == 2


def test_a_template_that_rerenders_earlier_turns_is_refused(encoder, tiny_ckpt):
    # a template that trims an assistant turn's text when it renders it (as Qwen3's drops
    # earlier turns' <think> blocks): ids built from the untrimmed text cannot continue
    copy = PromptEncoder(tiny_ckpt, encoder.data_cfg)
    copy.processor.chat_template = copy.processor.chat_template.replace(
        "{{ message['content'] }}", "{{ message['content'] | trim }}"
    )
    samples = rows(1)
    prompts = [copy.encode(samples[0])]
    backend = Scripted(copy, [[call_text(query_of(samples[0].question), "hermes") + "   "], ["x"]])
    with pytest.raises(RlflowError) as caught:
        ToolScenes(copy, 2, SUFFIX, 60, "hermes").rollout(backend, prompts, samples, PARAMS)
    text = caught.value.diagnostics[0].render()
    assert "environment.template-rerenders" in text and "after model turn 1" in text
    at = len(prompts[0].text) + len(call_text(query_of(samples[0].question), "hermes"))
    assert f"first difference at character {at} " in text


def test_malformed_tool_calls_are_counted_and_answered(encoder):
    samples = rows(4)
    prompts = [encoder.encode(s) for s in samples]
    first = [
        call_text(query_of(samples[0].question), "hermes"),
        '<tool_call>{"name": "count", "arguments": {"color": </tool_call>',  # not JSON
        '<tool_call>{"name": "zoom", "arguments": {}}</tool_call>',  # no such tool
        "<answer>2</answer>",  # answers without calling the tool
    ]
    backend = Scripted(encoder, [first, ["<answer>1</answer>"] * 3])
    made = ToolScenes(encoder, 2, SUFFIX, 60, "hermes").rollout(backend, prompts, samples, PARAMS)
    sums = made.sums
    assert sums["env/tool_calls"] == 3 and sums["env/valid_tool_calls"] == 1
    assert sums["env/malformed_tool_calls"] == 2
    assert sums["env/malformed_tool_calls/json"] == 1
    assert sums["env/malformed_tool_calls/unknown_tool"] == 1
    assert sums["env/turns"] == 7 and sums["env/answered_without_tool"] == 3
    # only a trajectory that called the tool validly has its answer scored
    assert made.reward_texts == ["<answer>1</answer>", "", "", ""]
    told = encoder.tokenizer.decode(made.completions[2].token_ids, skip_special_tokens=False)
    assert "error: unknown tool 'zoom'; the tool is count" in told
    assert len(backend.calls[1]) == 3  # the answer without a call ended its trajectory


def test_compact_calls_are_run_and_their_mistakes_counted(encoder):
    samples = rows(6)
    prompts = [encoder.encode(s) for s in samples]
    first = [
        call_text(query_of(samples[0].question), "compact"),  # count blue objects
        "<tool_call>count objects</tool_call>",  # every object
        "<tool_call>zoom red</tool_call>",  # no such tool
        "<tool_call>count red blue</tool_call>",  # two colours
        "<tool_call></tool_call>",  # no tool name
        "<tool_call>count red</tool_call><tool_call>count circles</tool_call>",  # two at once
    ]
    backend = Scripted(encoder, [first, ["<answer>1</answer>"] * 6])
    made = ToolScenes(encoder, 2, SUFFIX, 60, "compact").rollout(backend, prompts, samples, PARAMS)
    sums = made.sums
    assert first[0] == f"<tool_call> count {query_of(samples[0].question).noun()}</tool_call>"
    assert sums["env/valid_tool_calls"] == 4 and sums["env/malformed_tool_calls"] == 3
    for reason in ("unknown_tool", "bad_arguments", "json"):
        assert sums[f"env/malformed_tool_calls/{reason}"] == 1
    told = [
        encoder.tokenizer.decode(c.token_ids, skip_special_tokens=False) for c in made.completions
    ]
    answer = count(samples[0].scene, query_of(samples[0].question))
    assert f"<tool_response>\n{answer}\n</tool_response>" in told[0]
    assert f"<tool_response>\n{len(samples[1].scene.objects)}\n</tool_response>" in told[1]
    assert made.reward_texts == ["<answer>1</answer>"] * 2 + [""] * 3 + ["<answer>1</answer>"]
    # both results of the two calls in one user turn, then the answer
    assert "</tool_response>\n<tool_response>" in told[5] and told[5].count("<|im_start|>") == 2
    # the warm start's reference calls the tool in the compact form
    reference = ToolScenes(encoder, 2, SUFFIX, 60, "compact").reference(samples[0], prompts[0])
    assert first[0] in encoder.tokenizer.decode(reference.token_ids)
