"""Tool calls in a model's turn, in the Hermes / Qwen2.5 format that their chat templates teach:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "482 * 37"}}
    </tool_call>

`parse_turn(text)` splits a turn into its content (the text outside the blocks) and its calls, in order. A block
that is not a call (malformed JSON, no name, arguments that are not an object, a block left open) is still a call
attempt: it comes back with `error` set, so the model is told what was wrong and the attempt is counted. Whether the
name is a tool of the row and the arguments fit it is decided by `grpo.agents.tools.ToolSet.check`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    """One `<tool_call>` block. `error` is None for a well-formed call, else why the block is not one."""

    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None

    def as_message_call(self) -> dict:
        """The call as a chat message's `tool_calls` entry (transformers' and TRL's shape)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    content: str  # the turn's text with every tool-call block taken out
    calls: list[ToolCall]


def parse_turn(text: str) -> ParsedTurn:
    """The content and the tool calls of one model turn (decoded text, end-of-turn token removed)."""
    content, calls, position = [], [], 0
    while True:
        start = text.find(OPEN, position)
        if start < 0:
            content.append(text[position:])
            break
        content.append(text[position:start])
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            calls.append(ToolCall(None, error=f"the {OPEN} block is not closed by {CLOSE}"))
            break
        calls.append(parse_call(text[start + len(OPEN):end]))
        position = end + len(CLOSE)
    return ParsedTurn("".join(content).strip(), calls)


def parse_call(body: str) -> ToolCall:
    """The JSON object inside one block: {"name": str, "arguments": object (or a JSON string of one)}."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall(None, error=f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
    if not isinstance(value, dict):
        return ToolCall(None, error=f"the tool call must be a JSON object, got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, error='the tool call has no "name" string')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(name, error=f'the "arguments" of {name} are a string that is not a JSON object')
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f'the "arguments" of {name} must be a JSON object, got '
                                    f'{type(arguments).__name__}')
    return ToolCall(name, arguments)
