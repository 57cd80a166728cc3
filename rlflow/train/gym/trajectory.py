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

One exception, exact too: Gym's converter (`ResponsesConverter`) leaves an assistant turn with
neither text nor tool calls (one that generated only its end-of-turn token) out of the next
request, ids and all, so the conversation goes on from the turn before it. When the next turn's
prompt continues the conversation *before* such an empty turn, the episode is the conversation
the model actually saw: the empty turn is not trained on (it is no part of what later turns
were generated from) and is counted (`Trajectory.left_out`, the metric
`env/empty_turns_left_out`).
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
    left_out: int = 0  # empty turns Gym left out of the conversation (not trained on)


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
    turns = [(i, item) for i, item in enumerate(output) if _carries_ids(item)]
    if not turns:
        raise TaskFailed("no_token_ids", "no model turn carries generation_token_ids")
    seq: list[int] = []  # the episode: prompt, then each turn's environment and model ids
    logprobs, mask = [], []
    prompt_len = None  # the first turn's prompt (the trajectory's prompt) ends here
    context: list[int] = []  # the conversation so far: the ids the next prompt must start with
    undo = None  # (context, len(seq)) before the last turn, when Gym left that turn out
    left_out, start = 0, 0
    for k, (end, turn) in enumerate(turns):
        turn_prompt = [int(t) for t in turn["prompt_token_ids"]]
        if not _extends(turn_prompt, context) and undo and _extends(turn_prompt, undo[0]):
            context, n = undo  # the previous turn was empty and Gym went on without it
            del seq[n:], logprobs[n:], mask[n:]
            left_out += 1
            prompt_len = None if n == 0 else prompt_len
        elif not _extends(turn_prompt, context):
            at = next(
                (i for i, (a, b) in enumerate(zip(turn_prompt, context)) if a != b),
                min(len(turn_prompt), len(context)),
            )
            raise TaskFailed(
                "discontinuous_tokens",
                f"turn {k}'s prompt differs from the conversation so far at token {at} "
                "(the chat template re-rendered an earlier turn differently)",
            )
        undo = (context, len(seq)) if _left_out_by_gym(output[start : end + 1]) else None
        added = turn_prompt[len(context) :]
        generated = [int(t) for t in turn["generation_token_ids"]]
        lps = [float(x) for x in turn["generation_log_probs"]]
        if len(lps) != len(generated):
            raise TaskFailed(
                "malformed_json", f"turn {k}: {len(generated)} tokens, {len(lps)} logprobs"
            )
        prompt_len = len(turn_prompt) if prompt_len is None else prompt_len
        seq += added + generated
        logprobs += [0.0] * len(added) + lps
        mask += [0] * len(added) + [1] * len(generated)
        context = turn_prompt + generated
        start = end + 1
    ids, logprobs, mask = seq[prompt_len:], logprobs[prompt_len:], mask[prompt_len:]
    completion = Completion(
        token_ids=ids,
        logprobs=logprobs,
        finish_reason="stop",
        loss_mask=mask,
        token_versions=[version] * len(ids),
    )
    trained = len(turns) - left_out
    malformed = malformed_tool_calls(output)
    return Trajectory(seq[:prompt_len], completion, float(reward), trained, malformed, left_out)


def _carries_ids(item) -> bool:
    return isinstance(item, dict) and "generation_token_ids" in item


def _extends(ids: list[int], prefix: list[int]) -> bool:
    return ids[: len(prefix)] == prefix


def _left_out_by_gym(items: list) -> bool:
    """Whether Gym's converter leaves this turn out of the next request: its output items (those
    since the previous turn) are an assistant message with no text (what Gym makes of a turn
    that generated nothing to show) and no function call or reasoning with text."""
    empty_message = False
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "function_call":
            return False
        if kind == "reasoning" and any((s or {}).get("text") for s in item.get("summary") or []):
            return False
        if kind == "message" and item.get("role") == "assistant":
            if any(isinstance(p, dict) and p.get("text") for p in item.get("content") or []):
                return False
            empty_message = True
    return empty_message


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
