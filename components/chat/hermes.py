"""Hermes-style tool calls inside a ChatML template, as Qwen3 and Qwen2.5 write them.

    <|im_start|>system\\n...# Tools ... <tools>{schema}</tools> ...<|im_end|>\\n
    <|im_start|>user\\n{question}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}\\n<tool_call>\\n{"name": "python", "arguments": {"code": "..."}}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{stdout}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n...

The model directory's own chat template renders everything: the prompt is the template's render of the system
and user turns with the generation prompt; an observation is the template's render of a tool message after an
assistant turn, cut right after that turn's `<|im_end|>` (the stop the engine sampled), so the bridge back to
the next assistant turn is whatever the template writes there. An assistant turn of a trace is the template's
render of that message alone. Each piece is one call of the template on a short conversation, and the pieces
concatenate to the template's render of the whole conversation (tests/chat/test_token_in_token_out.py, which
lists the intended differences); a template that does not extend a conversation turn by turn is refused.
"""

from __future__ import annotations

import json
from typing import Any

from components.chat.format import ChatFormat, FormatError, require_tokens
from components.contracts.chat import ModelTurn, Prompt, ToolCall
from components.contracts.trace import Turn

END_OF_TURN = "<|im_end|>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOKENS = ("<|im_start|>", END_OF_TURN, CALL_OPEN, CALL_CLOSE, "<tool_response>", "</tool_response>")
"""What the format needs as single tokens of the vocabulary."""
TEMPLATE_MARKS = (CALL_OPEN, "tool_response", "<|im_start|>")
"""What a chat template must mention to be recognised as this format."""
_STUB_USER = {"role": "user", "content": "?"}
_STUB_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {"code": "pass"}}}],
}


def is_hermes_template(template: str | None) -> bool:
    return bool(template) and all(mark in template for mark in TEMPLATE_MARKS)


class HermesFormat(ChatFormat):
    name = "hermes"
    markup = (*TOKENS, THINK_OPEN, THINK_CLOSE, "<|endoftext|>")

    def __init__(self, tokenizer, where: str = "the tokenizer") -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise FormatError(
                f"{where}: the hermes chat format needs the model's chat template; the tokenizer has none"
            )
        if not is_hermes_template(template):
            missing = [m for m in TEMPLATE_MARKS if m not in template]
            raise FormatError(
                f"{where}: the chat template is not a Hermes tool-call template (it never writes {missing})"
            )
        ids = require_tokens(tokenizer, TOKENS, self.name, where)
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        eos = "<|endoftext|>"
        self.stop_token_ids = (ids[END_OF_TURN],) + ((vocab[eos],) if eos in vocab else ())
        self._stops = (END_OF_TURN, eos)
        self.thinks = THINK_OPEN in vocab and THINK_CLOSE in vocab
        self._observation = self._bridge()
        self._turn_prefix = self.render([_STUB_USER], generation_prompt=True)

    def render(self, messages: list[dict[str, Any]], tools=(), generation_prompt: bool = False) -> str:
        """The template's text for `messages` (OpenAI-style dicts)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=list(tools) or None, tokenize=False, add_generation_prompt=generation_prompt
        )

    def prompt_text(self, prompt: Prompt) -> str:
        return self.render(prompt_messages(prompt), prompt.tools, generation_prompt=True)

    def _bridge(self) -> tuple[str, str]:
        """The text around a tool's output from the end of the calling turn's `<|im_end|>` to the next generation
        prompt, as the template writes it: `(before, after)`."""
        base = self.render([_STUB_USER, _STUB_CALL])
        sentinel = "\x00SAO-OUTPUT\x00"
        full = self.render([_STUB_USER, _STUB_CALL, {"role": "tool", "content": sentinel}], generation_prompt=True)
        cut = base.rfind(END_OF_TURN)
        if cut < 0 or not full.startswith(base) or full.count(sentinel) != 1:
            raise FormatError(
                "the chat template does not render a tool response as an extension of the turn that called the tool"
            )
        text = base[cut + len(END_OF_TURN) :] + full[len(base) :]
        before, after = text.split(sentinel)
        return before, after

    def observation_text(self, output: str) -> str:
        before, after = self._observation
        return before + output + after

    def parse(self, text: str, truncated: bool) -> ModelTurn:
        """Reasoning up to `</think>` (the opening tag may be in the prompt), then content, then at most one
        `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A call that is not that is a `call_error`;
        a turn cut off by the token limit is never one (it ends the episode as `length`)."""
        body, ended = text, False
        for stop in self._stops:
            if body.endswith(stop):
                body, ended = body[: -len(stop)], not truncated
                break
        reasoning = None
        if THINK_CLOSE in body:
            head, _, body = body.partition(THINK_CLOSE)
            reasoning = head.removeprefix(THINK_OPEN).strip("\n")
        start = body.find(CALL_OPEN)
        if start < 0:
            return ModelTurn(text, body.strip(), reasoning, ended=ended)
        content = body[:start].strip()
        if truncated:
            return ModelTurn(text, content, reasoning)
        call, error = parse_call(body[start:])
        return ModelTurn(text, content, reasoning, call=call, call_error=error, ended=ended and call is None)

    def action_text(self, turn: Turn) -> str:
        """The template's render of the assistant message alone, up to and including its `<|im_end|>`."""
        return self._assistant_text(assistant_message(turn))

    def turn_text(self, turn: ModelTurn) -> str:
        """The template's render of `turn` as an assistant message, any tool call with it (as `action_text`)."""
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.reasoning:
            message["reasoning_content"] = turn.reasoning
        if turn.call is not None:
            call = {"name": turn.call.name, "arguments": turn.call.arguments}
            message["tool_calls"] = [{"type": "function", "function": call}]
        return self._assistant_text(message)

    def _assistant_text(self, message: dict[str, Any]) -> str:
        full = self.render([_STUB_USER, message])
        if not full.startswith(self._turn_prefix):
            raise FormatError("the chat template does not render an assistant turn after its generation prompt")
        text = full[len(self._turn_prefix) :]
        return text[: text.rindex(END_OF_TURN) + len(END_OF_TURN)]


def parse_call(text: str) -> tuple[ToolCall | None, str | None]:
    """`(call, None)` for exactly one well-formed `<tool_call>` block at the start of `text`, else `(None, why)`."""
    if text.count(CALL_OPEN) > 1:
        return None, f"one tool call per turn, got {text.count(CALL_OPEN)}"
    end = text.find(CALL_CLOSE)
    if end < 0:
        return None, "the tool call has no closing </tool_call>"
    payload = text[len(CALL_OPEN) : end].strip()
    try:
        value = json.loads(payload)
    except json.JSONDecodeError as exc:
        return None, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None, "the tool call's arguments are a string that is not a JSON object"
    if not isinstance(arguments, dict):
        return None, f"the tool call's arguments must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(value["name"], arguments), None


def prompt_messages(prompt: Prompt) -> list[dict[str, Any]]:
    system = [{"role": "system", "content": prompt.system}] if prompt.system else []
    return [*system, {"role": "user", "content": prompt.user}]


def assistant_message(turn: Turn) -> dict[str, Any]:
    """A trace's assistant turn as an OpenAI-style message (reasoning as `reasoning_content`, the code as a python
    tool call)."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.reasoning:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_code is not None:
        call = {"name": "python", "arguments": {"code": turn.tool_code}}
        message["tool_calls"] = [{"type": "function", "function": call}]
    return message
