"""Prompts: chat messages per media kind, and reference completions that earn full reward."""

from __future__ import annotations

import pytest

from rlflow.data import build_dataset, reference_completion, score, to_messages
from rlflow.data.sample import Sample

SUFFIX = " Answer with a number in <answer></answer> tags."


@pytest.mark.parametrize(
    "kind, media_entries", [("clevr", ["image"]), ("video", ["video"]), ("text", [])]
)
def test_messages_have_one_media_entry_then_the_question(configs, kind, media_entries):
    sample = build_dataset(*configs(kind))[0]
    (message,) = to_messages(sample, SUFFIX)
    assert message["role"] == "user"
    *media, text = message["content"]
    assert [m["type"] for m in media] == media_entries
    assert media == [{"type": t} for t in media_entries]  # pixels travel beside, not inside
    assert text == {"type": "text", "text": sample.question + SUFFIX}
    assert "<image>" not in text["text"] and "<video>" not in text["text"]


def test_one_image_entry_per_image():
    two = Sample(id="x", media="image", question="Same?", answer="yes", images=(object(), object()))
    assert [c["type"] for c in to_messages(two, "")[0]["content"]] == ["image", "image", "text"]


def test_reference_completions_earn_full_reward(configs, base_data):
    dataset = build_dataset(*configs("mixed", num_samples=30))
    samples = [dataset[i] for i in range(len(dataset))]
    completions = [reference_completion(s) for s in samples]
    assert completions[0] == f"<answer>{samples[0].answer}</answer>"
    totals, _, correct = score(completions, samples, {"format": 0.2, "exact_match": 0.8})
    assert totals == [1.0] * 30 and all(correct)


def test_the_default_prompt_names_the_format_the_rewards_parse():
    """The answer format has one home (rlflow.data.prompts); base.yaml's prompt suffix, the
    warm start's target and the rewards' parser all agree with it."""
    from pathlib import Path

    from rlflow.data.prompts import ANSWER_CLOSE, ANSWER_OPEN, ANSWER_RE, format_answer
    from rlflow.data.rewards import extract_answer
    from rlflow.recipe.load import load_recipe

    base = Path(__file__).resolve().parents[2] / "recipes" / "base.yaml"
    suffix = load_recipe(base).recipe.data.prompt_suffix
    assert f"{ANSWER_OPEN}{ANSWER_CLOSE}" in suffix
    assert ANSWER_RE.fullmatch(format_answer(7)) and extract_answer(format_answer(" 7 ")) == "7"
    sample = Sample(id="x", media="text", question="How many?", answer="7")
    assert reference_completion(sample) == format_answer("7")
