"""What an environment and a chat format exchange, whatever the model's own format is.

An episode opens with a `Prompt` (the user's question, an optional system prompt and the tools the model may
call). The chat format (components/chat) turns it into the prompt's token ids, and turns each sampled model
turn back into a `ModelTurn`: the reasoning, the prose, and either one tool call or a final answer. The
environment answers a tool call with the tool's output text; the format renders that as observation ids. So
an environment never sees a marker, a `<tool_call>` tag or a template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program and return what it prints (stdout), or its last error line.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program to run."}},
            "required": ["code"],
        },
    },
}
"""The one tool of tool-integrated reasoning and of the coding environment, as an OpenAI function schema (the
form chat templates take in `tools`)."""


@dataclass(frozen=True)
class Prompt:
    user: str
    """The user's turn: the task's question."""
    system: str | None = None
    """A system prompt, or None."""
    tools: tuple[dict[str, Any], ...] = ()
    """Function schemas of the tools the model may call (e.g. `PYTHON_TOOL`); empty for tool-less tasks."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    """The function the model called."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Its arguments, as parsed from the model's text."""


@dataclass(frozen=True)
class ModelTurn:
    """One sampled model turn, parsed by the chat format."""

    text: str
    """The decoded turn as sampled, its stop token included (for logs and for text-level graders)."""
    content: str
    """The prose of the turn: reasoning, tool-call markup and the stop token removed."""
    reasoning: str | None = None
    """The turn's reasoning (a `<think>` block), or None when it has none."""
    call: ToolCall | None = None
    """The tool call the turn ends with; None for a final answer or a malformed call."""
    call_error: str | None = None
    """Why the turn's tool call could not be parsed (bad JSON, no name, ...); None when it parsed or there was
    none."""
    ended: bool = False
    """The turn ended on the format's end-of-turn token (not on a tool call, not cut off by the token limit)."""

    @property
    def is_final(self) -> bool:
        """An answer that ends the episode: no tool call, well-formed or not."""
        return self.call is None and self.call_error is None


def check_call(call: ToolCall, tools: tuple[dict[str, Any], ...]) -> str | None:
    """What is wrong with `call` against the tool schemas an episode offered (`Prompt.tools`): an unknown tool,
    a missing required argument or an argument of the wrong JSON type. None when it is fine."""
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
    if call.name not in by_name:
        return f"unknown tool {call.name!r}; the tools are {sorted(by_name)}"
    parameters = by_name[call.name].get("parameters", {})
    properties = parameters.get("properties", {})
    for name in parameters.get("required", ()):
        if name not in call.arguments:
            return f"tool {call.name!r}: missing argument {name!r}"
    for name, value in call.arguments.items():
        if name not in properties:
            return f"tool {call.name!r}: unknown argument {name!r}"
        expected = properties[name].get("type")
        if expected in _JSON_TYPES and not _is_type(value, expected):
            return f"tool {call.name!r}: argument {name!r} must be a {expected}, got {type(value).__name__}"
    return None


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def _is_type(value: Any, expected: str) -> bool:
    if expected in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _JSON_TYPES[expected])
