"""A built-in environment's task that fails (rlflow/environment/trajectory.py `call_tool`): its
tool raises, hangs past `environment.task_timeout_s`, or answers something that is no tool
result. The trajectory ends there, is reported in `EnvRollouts.failed` with its reason, and the
trainer counts it (`env/failed_tasks/<reason>`) or stops naming the row
(`environment.on_task_failure`).

The tool_scenes task on the tiny checkpoint's real tokenizer and template, the policy's turns
scripted (`Scripted`: a random tiny model cannot be made to write a valid call). The faults are
injected by replacing tool_scenes' tool (monkeypatch): its real tool cannot fail.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from rlflow.environment import tool_scenes
from rlflow.environment.tool_scenes import ToolScenes, call_text, query_of
from rlflow.environment.trajectory import turn_versions
from rlflow.errors import RlflowError
from rlflow.model.processor import PromptEncoder
from rlflow.train.collect import environment_sums
from tests.environment.test_environment_tool_scenes import PARAMS, SUFFIX, Scripted, rows
from tests.tiny import base_recipe


def raises(call, scene):
    raise ConnectionError("the tool's backend went away")


class Hangs:
    """A tool that answers only once the test releases it (after the task has timed out)."""

    def __init__(self):
        self.release = threading.Event()

    def __call__(self, call, scene):
        self.release.wait()
        return "3", None


def malformed(call, scene):
    return {"count": 3}  # not (text, reason)


@pytest.fixture(scope="module")
def encoder(tiny_ckpt):
    data = dataclasses.replace(base_recipe().data, prompt_suffix=SUFFIX)
    return PromptEncoder(tiny_ckpt, data)


def recipe(on_task_failure: str):
    r = base_recipe()
    env = dataclasses.replace(r.environment, kind="tool_scenes", max_turns=2,
                              on_task_failure=on_task_failure)  # fmt: skip
    return dataclasses.replace(r, environment=env)


@pytest.mark.parametrize(
    "tool, reason, words",
    [
        (raises, "tool_error", "ConnectionError: the tool's backend went away"),
        (Hangs, "timeout", "ran past the task's 0.2 s"),
        (malformed, "malformed_result", "the tool answered {'count': 3}"),
    ],
    ids=["raises", "hangs", "malformed"],
)
def test_a_failing_tool_fails_its_task_not_the_run(encoder, monkeypatch, tool, reason, words):
    samples = rows(3)
    prompts = [encoder.encode(s) for s in samples]
    real = tool_scenes.run_tool
    tool = tool() if tool is Hangs else tool
    ran = []

    def routed(call, scene):  # row 1's calls go to the failing tool; rows 0 and 2 get the real one
        if scene is samples[1].scene:
            ran.append(call)
            return tool(call, scene)
        return real(call, scene)

    monkeypatch.setattr(tool_scenes, "run_tool", routed)
    first = [call_text(query_of(s.question), "hermes") for s in samples]
    first[1] *= 2  # two calls in one turn: the second is not run once the first failed
    backend = Scripted(encoder, [first, ["<answer>1</answer>"] * 2])
    try:
        made = ToolScenes(encoder, 2, SUFFIX, 0.2, "hermes").rollout(
            backend, prompts, samples, PARAMS
        )
    finally:
        if isinstance(tool, Hangs):
            tool.release.set()
    assert list(made.failed) == [1]
    got, detail = made.failed[1]
    assert got == reason and words in detail and "after model turn 1" in detail, detail
    assert len(backend.calls[1]) == 2 and len(ran) == 1  # the failed task ended there
    assert made.reward_texts == ["<answer>1</answer>", "", "<answer>1</answer>"]

    sums = environment_sums(recipe("continue"), made, samples)
    assert sums["env/failed_tasks"] == 1 and sums[f"env/failed_tasks/{reason}"] == 1
    assert sum(v for k, v in sums.items() if k.startswith("env/failed_tasks/")) == 1
    with pytest.raises(RlflowError) as caught:
        environment_sums(recipe("stop"), made, samples)
    [diagnostic] = caught.value.diagnostics
    text = diagnostic.render()
    assert diagnostic.code == "environment.task-failed" and f"row `{samples[1].id}`" in text
    assert f"({reason})" in text and "environment.on_task_failure: continue" in text


def test_each_model_turns_weight_version_is_kept():
    assert turn_versions([0, 1, 1, 0, 0, 1, 1, 0, 1], [3, 3, 3, 3, 4, 4, 4, 4, 4]) == [3, 4, 4]
    assert turn_versions([1, 1, 1], [2, 2, 3]) == [2, 3]  # a turn continued on newer weights


def test_gym_validates_single_turn(encoder):
    """With environment.kind gym the steps' rollouts are Gym's; validation generates
    single-turn on data.validation, as docs/gym.md says (it raised `unknown kind` before)."""
    from rlflow.environment.factory import make_environment
    from rlflow.environment.single_turn import SingleTurn

    r = base_recipe()
    gym = dataclasses.replace(r, environment=dataclasses.replace(r.environment, kind="gym"))
    assert isinstance(make_environment(gym, encoder), SingleTurn)
