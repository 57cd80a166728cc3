"""The `environment` section's rules (rlflow/rules/environment.py, the inert max_turns and the
kind's did-you-mean), through load_checked as the dry run and `rlflow train` run them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.errors import RlflowError
from rlflow.rules import load_checked

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "recipes" / "tiny-qwen3-text-tools-1n1g-cpu.yaml"
TEXT = ROOT / "recipes" / "tiny-qwen3-text-1n1g-cpu.yaml"


def refused(recipe: Path, overrides: list[str]) -> str:
    with pytest.raises(RlflowError) as caught:
        load_checked(recipe, overrides)
    return "\n".join(d.render() for d in caught.value.diagnostics)


def test_tool_scenes_needs_two_turns_scenes_and_no_overlong_penalty():
    text = refused(TOOLS, ["environment.max_turns=1"])
    assert "recipe.environment-turns" in text and "set environment.max_turns: 2" in text
    text = refused(TOOLS, ["data.validation.kind=jsonl", "data.validation.path=v.jsonl"])
    assert "recipe.environment-data" in text and "`data.validation.kind` is jsonl" in text
    text = refused(TOOLS, ["loss.overlong_penalty.enabled=true"])
    assert "recipe.environment-overlong" in text
    assert "recipe.environment-backend" in refused(TOOLS, ["generation.backend=vllm"])


def test_single_turn_refuses_max_turns_and_a_misspelt_kind():
    text = refused(TEXT, ["environment.max_turns=3"])
    assert "environment.max_turns" in text and "single_turn" in text
    text = refused(TEXT, ["environment.kind=tool_scene"])
    assert "did you mean 'tool_scenes'?" in text
    text = refused(TEXT, ["environment.on_task_failure=stop", "environment.task_timeout_s=5"])
    assert "environment.on_task_failure" in text and "environment.task_timeout_s" in text
    assert "single_turn (no task that can fail)" in text
    text = refused(TEXT, ["environment.tool_call_format=compact"])
    assert "environment.tool_call_format" in text and "not tool_scenes" in text
    assert "'hermes'" in refused(TOOLS, ["environment.tool_call_format=json"])
