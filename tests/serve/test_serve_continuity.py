"""Token continuity over real HTTP with the `openai` client: a second turn that sends the first
turn's ids back on its assistant message gets a prompt that starts with the first turn's prompt +
generated ids (never the decoded text tokenized again), and requests whose ids cannot be
continued get a 400 naming the message."""

from __future__ import annotations

import base64
import io

import openai
import pytest

from tests.serve.conftest import MODEL
from tests.tiny import random_image


def _turn(client, messages, **kwargs):
    completion = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    choice = completion.choices[0]
    extra = choice.message.model_extra
    return choice, extra["prompt_token_ids"], extra["generation_token_ids"]


def _assistant(content, prompt_ids, generated_ids) -> dict:
    """The assistant message as NeMo Gym's vllm_model sends an earlier turn back."""
    return {
        "role": "assistant", "content": content, "prompt_token_ids": prompt_ids,
        "generation_token_ids": generated_ids, "generation_log_probs": [0.0] * len(generated_ids),
    }  # fmt: skip


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_the_second_turn_continues_the_first_turns_ids(client, tiny_processor):
    """Text and an image conversation; the first turn cut by max_tokens (the template closes it)
    and ended by the end-of-turn token. The assistant's text is replaced by other text: the ids
    come from the ids sent back, not from the text."""
    eos = tiny_processor.tokenizer.eos_token_id
    image = {"type": "image_url", "image_url": {"url": _data_url(random_image(7))}}
    firsts = [
        ([{"role": "user", "content": "How many red cubes?"}], dict(max_tokens=6, seed=3)),
        ([{"role": "user", "content": [image, {"type": "text", "text": "Count the spheres."}]}],
         dict(max_tokens=6, seed=5)),
        ([{"role": "user", "content": "Count."}], dict(max_tokens=3, seed=1)),
    ]  # fmt: skip
    for k, (messages, kwargs) in enumerate(firsts):
        choice, prompt, generated = _turn(client, messages, **kwargs)
        if k == 2:  # a turn that ended with the end-of-turn token (the random model rarely does)
            generated = [*generated, eos]
        follow = [_assistant("other text " * 3, prompt, generated),
                  {"role": "user", "content": "And how many blue ones?"}]  # fmt: skip
        second, prompt2, generated2 = _turn(client, messages + follow, max_tokens=4, seed=9)
        assert prompt2[: len(prompt) + len(generated)] == prompt + generated
        added = prompt2[len(prompt) + len(generated) :]
        assert added[0] == eos if generated[-1] != eos else added[0] != eos
        assert "blue" in tiny_processor.tokenizer.decode(added)
        # the third turn continues the second's ids, which hold the first's
        follow2 = [_assistant(second.message.content, prompt2, generated2),
                   {"role": "user", "content": "Thanks."}]  # fmt: skip
        _, prompt3, _ = _turn(client, messages + follow + follow2, max_tokens=2, seed=1)
        assert prompt3[: len(prompt2) + len(generated2)] == prompt2 + generated2


def test_ids_that_cannot_be_continued_are_refused_naming_the_message(client):
    _, prompt, generated = _turn(client, [{"role": "user", "content": "hi"}], max_tokens=3, seed=2)
    user = {"role": "user", "content": "hi"}
    then = {"role": "user", "content": "more"}
    sent = _assistant("x", prompt, generated)
    cases = [
        ([{**user, "prompt_token_ids": prompt}], "messages[0].prompt_token_ids"),
        ([user, {**sent, "generation_token_ids": ["a"]}, then],
         "messages[1].generation_token_ids"),
        # a later assistant turn without ids would be re-tokenized from its text
        ([user, sent, then, {"role": "assistant", "content": "y"}, then],
         "messages[3].prompt_token_ids"),
        # ids of a one-turn conversation on the second assistant turn
        ([user, sent, then, sent, then], "messages[3].prompt_token_ids"),
        ([user, _assistant("x", prompt, [10**6]), then], "messages[1]"),
    ]  # fmt: skip
    for messages, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert caught.value.body["param"] == param, caught.value.body
        # Gym's vllm_model takes a 400 saying either for a turn that ran out of context
        message = caught.value.body["message"]
        assert message and "context length" not in message and "max_tokens" not in message


def test_the_splice_takes_nothing_before_the_turns_end_from_the_template():
    """The rule on ids (eos 2, "\\n" 9): a template that renders the earlier turn otherwise once
    a message follows (here: drops its text, as Qwen3's drops old thinking) still continues the
    ids sent back; a template that closes the turn otherwise, or never, is refused."""
    from rlflow.serve.chat import ApiError, Continuation
    from rlflow.serve.continuity import continue_ids

    sent = Continuation(1, prompt_ids=(1, 2, 3), generated_ids=(10, 11, 2))
    upto = [1, 2, 3, 40, 41, 2, 9]  # the template's text of the assistant turn: 40 41
    whole = [1, 2, 3, 2, 9, 7, 7, 3]  # the turn's text dropped, then a user message (7 7)
    assert continue_ids(sent, whole, upto, eos=2) == [1, 2, 3, 10, 11, 2, 9, 7, 7, 3]
    cut_off = Continuation(1, prompt_ids=(1, 2, 3), generated_ids=(10, 11))  # by max_tokens
    assert continue_ids(cut_off, whole, upto, eos=2) == [1, 2, 3, 10, 11, 2, 9, 7, 7, 3]
    for other_whole, other_upto, words in [
        ([1, 2, 3, 2, 8, 7], upto, "position 4"),  # the turn's end is "\n" 9 alone, then 8
        ([1, 3, 5, 7], [1, 3, 5], "end-of-turn token (id 2)"),  # a template without eos
    ]:
        with pytest.raises(ApiError) as caught:
            continue_ids(sent, other_whole, other_upto, eos=2)
        assert caught.value.param == "messages[1]" and words in caught.value.message
        assert caught.value.code == "discontinuous_tokens"
