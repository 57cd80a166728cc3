"""`environment.kind: tool_scenes`: the built-in multi-turn task. The policy must call a tool
on the row's scene before it answers.

A row is a synthetic counting scene (data kinds clevr, text, video, mixed: rows that carry a
scene graph). The one tool, in the hermes style of rlflow.serve.tools:

    <tool_call>{"name": "count", "arguments": {"color": "red", "shape": "square"}}</tool_call>

counts the scene's objects of that colour and/or shape (both optional). With
`environment.tool_call_format: compact` a call is the tool's name and the question's words
instead, `<tool_call> count red squares</tool_call>` (or `count objects`, `count circles`): a
few tokens a tiny model can learn, where the JSON is dozens. Each model turn that
ends with a call gets the result as a `tool` message, rendered by the chat template
(`<tool_response>...</tool_response>` in a user turn), and the policy goes on; a turn without a
call ends the trajectory, as does a turn cut at generation.max_new_tokens or the last of
environment.max_turns. The rewards read the last model turn, and only when an earlier turn
made a valid call: an answer given without calling the tool scores as no answer.

A malformed call (not JSON, an unknown tool, bad arguments, cut off by the token limit) is
answered with an error message, so the policy can try again in its next turn, and counted
(`env/malformed_tool_calls` and one metric per reason).
"""

from __future__ import annotations

import json
import re

from rlflow.data.scene import COLORS, SHAPES, Query, count
from rlflow.environment.base import Environment, EnvRollouts, turn_params
from rlflow.environment.trajectory import Trajectory
from rlflow.errors import Diagnostic, RlflowError
from rlflow.generation.base import Completion

TOOL = "count"
MALFORMED = ("json", "unknown_tool", "bad_arguments", "truncated")


def query_of(question: str) -> Query:
    """The colour and shape a counting question asks about: "How many red circles are there?"."""
    noun = question.rpartition("How many ")[2].partition(" are there")[0].split()
    color = next((w for w in noun if w in COLORS), None)
    shape = next((w.removesuffix("s") for w in noun if w.removesuffix("s") in SHAPES), None)
    return Query(color=color, shape=shape)


def call_text(query: Query, call_format: str) -> str:
    """The tool call a perfect policy makes for `query`, in `call_format` (hermes | compact)."""
    if call_format == "compact":
        return f"<tool_call> {TOOL} {query.noun()}</tool_call>"  # " count": one tiny token
    arguments = {k: v for k, v in (("color", query.color), ("shape", query.shape)) if v}
    return f"<tool_call>{json.dumps({'name': TOOL, 'arguments': arguments})}</tool_call>"


_COMPACT = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_COMPACT_HELP = "error: a call is <tool_call> count red squares</tool_call>"


def compact_calls(content: str) -> list[dict]:
    """The compact calls of a turn's text (`<tool_call> count red squares</tool_call>`), each in
    the OpenAI shape with its arguments as JSON, or {} for a call with no tool name."""
    out = []
    for match in _COMPACT.finditer(content):
        name, *words = match.group(1).split() or [""]
        arguments, bad = {}, False
        for word in words:
            shape = word.removesuffix("s")
            key = "color" if word in COLORS else "shape" if shape in SHAPES else None
            if word == "objects":
                continue
            bad = bad or key is None or key in arguments
            arguments[key] = word if key == "color" else shape
        text = "not arguments" if bad else json.dumps(arguments)
        out.append({"function": {"name": name, "arguments": text}} if name else {})
    return out


def run_tool(call: dict, scene) -> tuple[str, str | None]:
    """(the tool's answer, the malformed reason or None) of one parsed call (OpenAI shape)."""
    function = call["function"]
    if function["name"] != TOOL:
        return f"error: unknown tool {function['name']!r}; the tool is {TOOL}", "unknown_tool"
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict) or set(arguments) - {"color", "shape"}:
        return "error: arguments are an object with `color` and/or `shape`", "bad_arguments"
    color, shape = arguments.get("color"), arguments.get("shape")
    if color not in (None, *COLORS) or shape not in (None, *SHAPES):
        return f"error: color is one of {', '.join(COLORS)}; shape one of {', '.join(SHAPES)}", (
            "bad_arguments"
        )
    return str(count(scene, Query(color=color, shape=shape))), None


class ToolScenes(Environment):
    def __init__(
        self, encoder, max_turns: int, prompt_suffix: str, task_timeout_s: float, call_format: str
    ):
        self.encoder = encoder
        self.task_timeout_s = task_timeout_s
        self.max_turns = max_turns
        self.prompt_suffix = prompt_suffix
        self.call_format = call_format  # environment.tool_call_format: hermes | compact
        tokenizer = encoder.tokenizer
        self.stop_text = tokenizer.decode([encoder.eos_token_id], skip_special_tokens=False)

    def _start(self, sample, prompt) -> Trajectory:
        from rlflow.data.prompts import to_messages

        if sample.scene is None:
            raise RlflowError(
                Diagnostic(
                    "environment.no-scene",
                    f"row `{sample.id}` has no scene for the tool_scenes environment's tool",
                    help="tool_scenes needs synthetic rows (data kind clevr, text, video or "
                    "mixed); use environment.kind: single_turn for jsonl data",
                )
            )
        if self.encoder.multimodal:
            messages = to_messages(sample, self.prompt_suffix)
        else:
            messages = [{"role": "user", "content": sample.question + self.prompt_suffix}]
        return Trajectory(prompt, messages, prompt.text)

    def _model_turn(self, tr: Trajectory, completion: Completion, version: int) -> str:
        """Adds the policy's turn; returns its text without the stop token."""
        ids = completion.token_ids
        stopped = completion.finish_reason == "stop" and ids
        body = ids[:-1] if stopped else ids
        content = self.encoder.tokenizer.decode(body, skip_special_tokens=False)
        tr.add_model_turn(completion, content, self.stop_text if stopped else "", version)
        return content

    def _respond(self, tr: Trajectory, content: str, scene, sums: dict[str, float]) -> int:
        """The tool's messages for a turn that called it; returns the valid calls."""
        from rlflow.serve.tools import parse_tool_calls

        if self.call_format == "compact":
            calls = compact_calls(content)
        else:
            _, calls = parse_tool_calls(content)
        answers = [
            tr.call_tool(run_tool, (c, scene), self.task_timeout_s, _valid)
            if c else (_COMPACT_HELP, "json")
            for c in calls
        ]  # fmt: skip
        if tr.failure:  # the tool failed: the task ends here (rlflow/environment/trajectory.py)
            return 0
        if not calls:
            answers = [('error: a call is <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
                        "json")]  # fmt: skip
        for _, reason in answers:
            sums["env/tool_calls"] += 1
            if reason is None:
                sums["env/valid_tool_calls"] += 1
            else:
                sums["env/malformed_tool_calls"] += 1
                sums[f"env/malformed_tool_calls/{reason}"] += 1
        # One environment turn for all of a turn's results: the template renders consecutive
        # tool messages in one user turn, so adding them one by one (each followed by the next
        # assistant header) would not be what the template renders after the last.
        messages = [{"role": "tool", "content": text} for text, _ in answers]
        tr.messages.extend(messages[:-1])
        tr.add_environment_turn(messages[-1], self.encoder.processor, self.encoder.tokenizer)
        return sum(reason is None for _, reason in answers)

    def rollout(self, backend, prompts, samples, params) -> EnvRollouts:
        sums = {k: 0.0 for k in ("env/trajectories", "env/turns", "env/tool_calls",
                                 "env/valid_tool_calls", "env/malformed_tool_calls",
                                 "env/answered_without_tool")}  # fmt: skip
        sums.update({f"env/malformed_tool_calls/{reason}": 0.0 for reason in MALFORMED})
        trajectories = [self._start(s, p) for s, p in zip(samples, prompts, strict=True)]
        valid = [0] * len(trajectories)
        finals = [""] * len(trajectories)
        # Every turn calls the backend, with no rows once all are done: an expert-parallel
        # engine's peers need every rank in each generation pass.
        for turn in range(self.max_turns):
            active = [i for i, tr in enumerate(trajectories) if not tr.done]
            outs = backend.generate(
                [trajectories[i].turn_prompt() for i in active], turn_params(params, turn)
            )
            for i, completion in zip(active, outs, strict=True):
                tr = trajectories[i]
                content = self._model_turn(tr, completion, backend.weight_version)
                finals[i] = self.encoder.decode(completion.token_ids)
                calls = "<tool_call>" in content
                if calls and completion.finish_reason == "length":
                    sums["env/tool_calls"] += 1
                    sums["env/malformed_tool_calls"] += 1
                    sums["env/malformed_tool_calls/truncated"] += 1
                if not calls or completion.finish_reason == "length" or turn == self.max_turns - 1:
                    tr.done = True
                    continue
                valid[i] += self._respond(tr, content, samples[i].scene, sums)
        for tr, calls in zip(trajectories, valid):
            sums["env/trajectories"] += 1
            sums["env/turns"] += tr.model_turns
            sums["env/answered_without_tool"] += float(calls == 0)
        texts = [text if calls else "" for text, calls in zip(finals, valid)]
        failed = {i: tr.failure for i, tr in enumerate(trajectories) if tr.failure}
        return EnvRollouts([tr.completion() for tr in trajectories], texts, sums, failed)

    def reference(self, sample, prompt) -> Completion:
        tr = self._start(sample, prompt)
        from rlflow.data.prompts import format_answer

        call = call_text(query_of(sample.question), self.call_format)
        for text in (call, format_answer(sample.answer)):
            ids = self.encoder.completion_ids(text)
            self._model_turn(tr, Completion(ids, [0.0] * len(ids), "stop"), 0)
            if text.startswith("<tool_call>"):
                self._respond(tr, text, sample.scene, _scratch())
        return tr.completion()


def _valid(answer) -> bool:
    """A tool result: (its text, the malformed reason or None)."""
    return isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], str)


def _scratch() -> dict[str, float]:
    """Sums nobody reads (the warm start's reference calls are not metrics)."""
    from collections import defaultdict

    return defaultdict(float)
