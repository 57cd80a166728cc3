"""A NeMo Gym trajectory (the agent's /run answer) -> the Completion GRPO trains on.

Gym's `vllm_model` puts the server's token information on the last output item of each model
turn: `prompt_token_ids` (the whole conversation so far, as the server tokenized it),
`generation_token_ids` and `generation_log_probs` (the turn's sampled tokens and their
temperature-1 logprobs). The trajectory is the first turn's prompt, then for every turn the ids
the environment added since the previous turn's end (tool results, the next user message:
loss mask 0, logprob 0.0) and the turn's own tokens (loss mask 1). Continuity is checked, never
assumed: each turn's prompt must start with the previous prompt and generation exactly; a chat
template that re-renders an earlier turn differently is refused naming the turn and the first
differing position (the trajectory is a failed task, reason `discontinuous_tokens`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rlflow.generation.base import Completion

TOOL_CALL_TAG = "<tool_call>"  # the hermes tag rlflow's server parses (rlflow/serve/tools.py)


class TaskFailed(Exception):
    """A task that produced nothing to train on; `reason` is its metric's suffix."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class Trajectory:
    prompt_ids: list[int]
    completion: Completion
    reward: float
    turns: int
    malformed: dict[str, int] = field(default_factory=dict)  # reason -> tool calls


def convert(result: dict, version: int) -> Trajectory:
    """The agent's /run answer -> a Trajectory (every token of weight version `version`);
    TaskFailed when it cannot be trained on."""
    if not isinstance(result, dict) or not isinstance(result.get("response"), dict):
        raise TaskFailed("malformed_json", "the answer has no `response` object")
    reward = result.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TaskFailed("malformed_json", f"`reward` is {reward!r}, not a number")
    output = result["response"].get("output")
    if not isinstance(output, list):
        raise TaskFailed("malformed_json", "`response.output` is not a list")
    turns = [item for item in output if isinstance(item, dict) and "generation_token_ids" in item]
    if not turns:
        raise TaskFailed("no_token_ids", "no model turn carries generation_token_ids")
    prompt = [int(t) for t in turns[0]["prompt_token_ids"]]
    context = list(prompt)
    ids, logprobs, mask = [], [], []
    for k, turn in enumerate(turns):
        turn_prompt = [int(t) for t in turn["prompt_token_ids"]]
        if turn_prompt[: len(context)] != context:
            at = next(
                (i for i, (a, b) in enumerate(zip(turn_prompt, context)) if a != b),
                min(len(turn_prompt), len(context)),
            )
            raise TaskFailed(
                "discontinuous_tokens",
                f"turn {k}'s prompt differs from the conversation so far at token {at} "
                "(the chat template re-rendered an earlier turn differently)",
            )
        added = turn_prompt[len(context) :]
        generated = [int(t) for t in turn["generation_token_ids"]]
        lps = [float(x) for x in turn["generation_log_probs"]]
        if len(lps) != len(generated):
            raise TaskFailed(
                "malformed_json", f"turn {k}: {len(generated)} tokens, {len(lps)} logprobs"
            )
        ids += added + generated
        logprobs += [0.0] * len(added) + lps
        mask += [0] * len(added) + [1] * len(generated)
        context = turn_prompt + generated
    completion = Completion(
        token_ids=ids,
        logprobs=logprobs,
        finish_reason="stop",
        loss_mask=mask,
        token_versions=[version] * len(ids),
    )
    return Trajectory(prompt, completion, float(reward), len(turns), malformed_tool_calls(output))


def malformed_tool_calls(output: list) -> dict[str, int]:
    """The model's tool calls that could not run, by reason: a call whose `arguments` are not a
    JSON object (`arguments_not_json`), a tool the resources server does not have
    (`unknown_tool`), a `<tool_call>` block the server could not parse, left as text
    (`unparsed_tool_call`)."""
    out: dict[str, int] = {}

    def count(reason: str) -> None:
        out[reason] = out.get(reason, 0) + 1

    for item in output:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "function_call":
            try:
                if not isinstance(json.loads(item.get("arguments") or ""), dict):
                    count("arguments_not_json")
            except ValueError:
                count("arguments_not_json")
        elif kind == "function_call_output" and _not_found(item.get("output")):
            count("unknown_tool")
        elif kind == "message" and item.get("role") == "assistant":
            text = "".join(
                part.get("text", "") for part in item.get("content") or [] if isinstance(part, dict)
            )
            count_tags = text.count(TOOL_CALL_TAG)
            if count_tags:
                out["unparsed_tool_call"] = out.get("unparsed_tool_call", 0) + count_tags
    return out


def _not_found(output) -> bool:
    try:
        return json.loads(output) == {"detail": "Not Found"}  # FastAPI's 404 for an unknown path
    except (TypeError, ValueError):
        return False
