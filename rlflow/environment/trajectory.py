"""A multi-turn trajectory as training data: token ids built turn by turn, never re-tokenized.

A trajectory is the prompt followed by turns: the policy's tokens (trained: loss mask 1, with
the behaviour logprobs generation returned) and the environment's tokens (tool results: in the
context, loss mask 0, logprob 0.0). Each turn's prompt is exactly the previous turns' ids plus
the environment's ids. The environment's ids come from the chat template: the conversation is
rendered with the new message, and only the text after what was already built is tokenized. A
template that renders the earlier turns differently from the text the ids were built from
(Qwen3's drops earlier turns' `<think>` blocks, for example) cannot be continued exactly: it is
refused, naming the turn and the first differing character (`environment.template-rerenders`).

An environment's tool runs through `call_tool`, bounded by what is left of the task's time
(`environment.task_timeout_s`): a tool that raises, hangs past it, or answers something that is
not a tool result fails the trajectory (`failure`: reason and detail; it ends there) instead of
the run. `turn_versions` gives each model turn's weight version.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlflow.errors import Diagnostic, RlflowError
from rlflow.generation.base import Completion
from rlflow.model.media import Prompt


@dataclass
class Trajectory:
    """One rollout under construction: the prompt, then model and environment turns."""

    prompt: Prompt
    messages: list[dict]  # the chat so far, as the template renders it
    text: str  # the prompt's text plus every turn's, exactly as the ids were built
    token_ids: list[int] = field(default_factory=list)  # after the prompt
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    model_turns: int = 0
    done: bool = False
    failure: tuple[str, str] | None = None  # (reason, detail): the task failed, it ended there
    tool_seconds: float = 0.0  # spent in the environment's tools so far

    def turn_prompt(self) -> Prompt:
        """The next turn's prompt: the first prompt itself (its samples share one prefill), then
        the prompt's ids plus every turn's, with the same media."""
        if not self.token_ids:
            return self.prompt
        return dataclasses.replace(
            self.prompt,
            text=self.text,
            token_ids=tuple(self.prompt.token_ids) + tuple(self.token_ids),
        )

    def add_model_turn(self, completion: Completion, content: str, end: str, version: int):
        """The policy's turn: its tokens trained; `content` is its text without the stop
        token, `end` the stop token's text (empty when the turn ran out of tokens)."""
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.loss_mask += [1] * len(completion.token_ids)
        self.versions += [version] * len(completion.token_ids)
        self.finish_reason = completion.finish_reason
        self.messages.append({"role": "assistant", "content": content})
        self.text += content + end
        self.model_turns += 1

    def call_tool(self, tool: Callable, args: tuple, timeout_s: float, valid: Callable):
        """`tool(*args)`, bounded by what is left of `timeout_s` for this trajectory; its
        answer, or None when the task failed (`failure` says why; the trajectory is done): the
        tool raised (`tool_error`), did not answer in time (`timeout`; its thread is left to
        finish on its own), or answered something `valid` refuses (`malformed_result`). After
        a failure, later calls return None without running."""
        if self.failure:
            return None
        left = timeout_s - self.tool_seconds
        box: dict = {}

        def run() -> None:
            try:
                box["answer"] = tool(*args)
            except Exception as exc:  # the environment's own bug or outage: this task fails
                box["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=run, name="rlflow-env-tool", daemon=True)
        start = time.perf_counter()
        thread.start()
        thread.join(max(left, 0.0))
        self.tool_seconds += time.perf_counter() - start
        if thread.is_alive():
            self._fail("timeout", f"the tool ran past the task's {timeout_s:g} s")
        elif "error" in box:
            self._fail("tool_error", box["error"])
        elif not valid(box["answer"]):
            self._fail("malformed_result", f"the tool answered {box['answer']!r:.200}")
        return None if self.failure else box["answer"]

    def _fail(self, reason: str, detail: str) -> None:
        self.failure = (reason, f"after model turn {self.model_turns}: {detail}")
        self.done = True

    def add_environment_turn(self, message: dict, template, tokenizer) -> None:
        """The environment's message, as the chat template renders it after the conversation
        so far (with the next assistant header): context only, never trained."""
        self.messages.append(message)
        rendered = template.apply_chat_template(
            self.messages, add_generation_prompt=True, tokenize=False
        )
        if not rendered.startswith(self.text):
            raise RlflowError(_rerendered(self.model_turns, self.text, rendered))
        suffix = rendered[len(self.text) :]
        ids = tokenizer(suffix, add_special_tokens=False)["input_ids"]
        self.text = rendered
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)

    def completion(self) -> Completion:
        return Completion(
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason,  # the last model turn's
            loss_mask=list(self.loss_mask),
            token_versions=list(self.versions),
        )


def turn_versions(loss_mask: list[int], versions: list[int]) -> list[int]:
    """The weight version of each model turn (each run of loss-mask-1 tokens) of a trajectory."""
    out = []
    for i, (m, v) in enumerate(zip(loss_mask, versions, strict=True)):
        if m and (i == 0 or not loss_mask[i - 1] or versions[i - 1] != v):
            out.append(v)
    return out


def first_difference(a: str, b: str) -> int:
    """The first index where a and b differ (the shorter's length when one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _rerendered(turn: int, built: str, rendered: str) -> Diagnostic:
    at = first_difference(built, rendered)
    return Diagnostic(
        "environment.template-rerenders",
        f"after model turn {turn}, the chat template renders the conversation differently from "
        f"the tokens it was built from: first difference at character {at} "
        f"(built {built[at : at + 40]!r}, template {rendered[at : at + 40]!r})",
        help="a trajectory's ids are the previous turns' ids plus the environment's, never a "
        "re-tokenization; use a chat template that renders earlier assistant turns verbatim "
        "(Qwen3's removes their <think> blocks: use one that keeps them)",
    )
