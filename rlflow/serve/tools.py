"""Tool calls in the hermes style the Qwen chat templates use: `<tool_call>{json}</tool_call>`.

Qwen2.5 / Qwen3 templates list the request's `tools` in the system turn and ask the model to
answer a call as a JSON object {"name": ..., "arguments": {...}} between <tool_call> tags
(the template renders the assistant's earlier calls the same way). This module reads such calls
out of a completion's text, as vLLM's `hermes` tool parser does, into the OpenAI shape.
"""

from __future__ import annotations

import json
import re
import uuid

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the text before the first call, or None when empty; the calls in the OpenAI shape).

    A block that is not a JSON object with a string `name` stays text: the model's output is
    returned, never dropped."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for match in _CALL.finditer(text, start):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    content = text[:start].strip()
    return content or None, calls


def arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with their `arguments` JSON strings parsed, as the chat templates
    render them (vLLM does the same before templating)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls:
            message = dict(message)
            message["tool_calls"] = [_parsed(call) for call in calls]
        out.append(message)
    return out


def _parsed(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # the template renders the string as it is
    return {**call, "function": function}
