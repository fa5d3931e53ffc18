"""An OpenAI chat request's conversation as token ids, built through a chat format the way the agent runner builds
an episode (components/agent/runner.py): the prompt (system prompt, tool schemas, the user's turn), then each
earlier assistant turn as the model writes it (`ChatFormat.turn_text`) and each tool message as an observation
(`ChatFormat.observation_ids`), every piece tokenised on its own. A conversation the runner produced therefore
comes back as the runner's own ids wherever the engine sampled canonical tokens.

A conversation has the shape of an episode: an optional system message, one user message, then assistant
messages that each end in one tool call, each answered by one tool message; it ends on the user or tool message
the next turn answers. Anything else (a second user turn, two calls in one turn, an answer followed by more
messages, a system prompt to a format without one) has no rendering in the format and is refused with a
ValueError whose message starts with the field (`messages[2].tool_calls: ...`), never reshaped silently.
Unknown message keys are refused unless null (a client echoing a response message sends `refusal: null`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from components.chat.format import ChatFormat, encode
from components.contracts.chat import ModelTurn, Prompt, ToolCall

SYSTEM_ROLES = ("system", "developer")
"""`developer` is the newer OpenAI name of the system message."""
ROLES = (*SYSTEM_ROLES, "user", "assistant", "tool")
_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "reasoning_content"},
    "tool": {"role", "content", "tool_call_id"},
}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for a function name."""


def conversation_ids(chat: ChatFormat, messages: Any, tools: tuple[dict[str, Any], ...] = ()) -> list[int]:
    """The prompt ids of `messages` (OpenAI chat messages) offering `tools` (already checked by `check_tools`)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of messages")
    roles = [_role(message, i) for i, message in enumerate(messages)]
    if roles[-1] == "assistant":
        raise ValueError(f"messages[{len(messages) - 1}].role: the conversation must end on the message to answer")
    first = 0
    system = None
    if roles[0] in SYSTEM_ROLES:
        if not chat.has_system:
            raise ValueError(f"messages[0].role: the {chat.name} chat format has no system prompt")
        system, first = text_content(messages[0].get("content"), "messages[0].content"), 1
    if first >= len(messages) or roles[first] != "user":
        where = f"messages[{first}].role" if first < len(messages) else "messages"
        raise ValueError(f"{where}: the conversation must open with a user message (after an optional system one)")
    user = text_content(messages[first].get("content"), f"messages[{first}].content")
    ids = chat.prompt_ids(Prompt(user, system, tools))
    call_id = None
    for i in range(first + 1, len(messages)):
        expected = "assistant" if (i - first) % 2 == 1 else "tool"
        if roles[i] != expected:
            raise ValueError(
                f"messages[{i}].role: expected {expected!r}, got {roles[i]!r} (the {chat.name} chat format renders "
                "one user turn, then assistant turns that each end in one tool call and that call's tool message)"
            )
        if expected == "assistant":
            turn, call_id = assistant_turn(messages[i], i)
            try:
                ids += encode(chat.tokenizer, chat.turn_text(turn))
            except ValueError as exc:
                raise ValueError(f"messages[{i}].tool_calls[0]: {exc}") from exc
        else:
            ids += chat.observation_ids(tool_output(messages[i], i, call_id))
    return ids


def _role(message: Any, i: int) -> str:
    if not isinstance(message, dict):
        raise ValueError(f"messages[{i}]: must be an object with a role, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{i}].role: must be one of {list(ROLES)}, got {role!r}")
    unknown = sorted(k for k, v in message.items() if k not in _KEYS[role] and v is not None)
    if unknown:
        raise ValueError(f"messages[{i}].{unknown[0]}: not accepted on a {role} message")
    return role


def text_content(value: Any, where: str, optional: bool = False) -> str:
    """A message's content as text: a string, or a list of `{"type": "text", "text": ...}` parts joined; None is
    allowed only where `optional` (an assistant message with a tool call) and reads as empty."""
    if value is None and optional:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"{where}: must be a string or a list of text parts, got {type(value).__name__}")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}]: only text parts are accepted ({{'type': 'text', 'text': ...}})")
        texts.append(part["text"])
    return "".join(texts)


def assistant_turn(message: dict[str, Any], i: int) -> tuple[ModelTurn, str | None]:
    """An earlier assistant message (it must end in one tool call) as a `ModelTurn`, and its call's id."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or len(calls) != 1:
        got = "none" if not calls else (len(calls) if isinstance(calls, list) else type(calls).__name__)
        raise ValueError(
            f"messages[{i}].tool_calls: an assistant message before the last user or tool message must make exactly "
            f"one tool call, got {got}"
        )
    call, call_id = read_call(calls[0], f"messages[{i}].tool_calls[0]")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"messages[{i}].reasoning_content: must be a string, got {type(reasoning).__name__}")
    content = text_content(message.get("content"), f"messages[{i}].content", optional=True)
    return ModelTurn("", content, reasoning or None, call=call), call_id


def read_call(call: Any, where: str) -> tuple[ToolCall, str | None]:
    """One OpenAI tool call `{id, type: "function", function: {name, arguments}}`; the arguments a JSON object
    or a string holding one (OpenAI's form)."""
    if not isinstance(call, dict):
        raise ValueError(f"{where}: must be an object, got {type(call).__name__}")
    if call.get("type", "function") != "function":
        raise ValueError(f"{where}.type: must be 'function', got {call.get('type')!r}")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}.function.name: must be a non-empty string")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}.function.arguments: not valid JSON ({exc.msg} at character {exc.pos})") from exc
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments: must be a JSON object, got {type(arguments).__name__}")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise ValueError(f"{where}.id: must be a string")
    return ToolCall(function["name"], arguments), call_id


def tool_output(message: dict[str, Any], i: int, call_id: str | None) -> str:
    """A tool message's output; its `tool_call_id`, when both ids are there, must answer the call before it."""
    answered = message.get("tool_call_id")
    if answered is not None and call_id is not None and answered != call_id:
        raise ValueError(f"messages[{i}].tool_call_id: {answered!r} does not answer the call before it ({call_id!r})")
    return text_content(message.get("content"), f"messages[{i}].content")


def check_tools(chat: ChatFormat, tools: Any) -> tuple[dict[str, Any], ...]:
    """The request's `tools` as OpenAI function schemas the format can offer; a ValueError names the first bad
    field. A format whose prompt carries no schemas (`builtin_tools`) can be offered only the tools it has."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ValueError(f"tools: must be a list of function tools, got {type(tools).__name__}")
    names: set[str] = set()
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"tools[{j}].type: must be 'function' (an object {{'type': 'function', 'function': ...}})")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"tools[{j}].function: must be an object with a name")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tools[{j}].function.name: must match {_NAME.pattern}, got {name!r}")
        if name in names:
            raise ValueError(f"tools[{j}].function.name: {name!r} is offered twice")
        if chat.builtin_tools is not None and name not in chat.builtin_tools:
            raise ValueError(
                f"tools[{j}].function.name: the {chat.name} chat format can call only {list(chat.builtin_tools)} "
                f"(its prompt carries no tool schemas), got {name!r}"
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools[{j}].function.parameters: must be a JSON schema object")
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"tools[{j}].function.description: must be a string")
        names.add(name)
    return tuple(tools)
