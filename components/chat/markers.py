"""The project's own marker format (components/contracts/markers.py), the `tiny-cpu` default: one special token
per marker, the python tool built in, no system prompt, no reasoning channel.

    <|user|>{question}<|assistant|>{content}<|python|>{code}<|/python|><|output|>{stdout}<|/output|>...
    {content}\\boxed{answer}<|end|>

Its ids are the ones the pipeline has always produced, so results on `tiny-cpu` do not change.
"""

from __future__ import annotations

from components.chat.format import ChatFormat, require_tokens
from components.contracts.chat import ModelTurn, Prompt, ToolCall
from components.contracts.markers import (
    ASSISTANT,
    CALL,
    CALL_END,
    END,
    OUTPUT,
    OUTPUT_END,
    USER,
    answer_text,
    observation_text,
    prompt_text,
    tool_call_text,
)
from components.contracts.trace import Turn

TOKENS = (USER, ASSISTANT, CALL, CALL_END, OUTPUT, OUTPUT_END, END)
"""The markers the format needs as single tokens."""


class MarkerFormat(ChatFormat):
    name = "markers"
    markup = TOKENS
    has_system = False
    builtin_tools = ("python",)

    def __init__(self, tokenizer, where: str = "the tokenizer") -> None:
        ids = require_tokens(tokenizer, TOKENS, self.name, where)
        self.tokenizer = tokenizer
        self.stop_token_ids = (ids[CALL_END], ids[END])

    def prompt_text(self, prompt: Prompt) -> str:
        """`<|user|>{question}<|assistant|>`; the python tool is implied and there is no system prompt."""
        return prompt_text(prompt.user)

    def parse(self, text: str, truncated: bool) -> ModelTurn:
        return parse_turn(text, truncated)

    def observation_text(self, output: str) -> str:
        return observation_text(output)

    def action_text(self, turn: Turn) -> str:
        """The content, then the call or `<|end|>`; the marker format has no reasoning channel (it is dropped)."""
        if turn.tool_code is not None:
            return tool_call_text(turn.content, turn.tool_code)
        return answer_text(turn.content)

    def turn_text(self, turn: ModelTurn) -> str:
        """As `action_text`: a call must be the python tool's, with a string `code` and nothing else."""
        if turn.call is None:
            return answer_text(turn.content)
        code = turn.call.arguments.get("code")
        if turn.call.name != "python" or set(turn.call.arguments) != {"code"} or not isinstance(code, str):
            raise ValueError(
                'the markers chat format calls only the python tool, with arguments {"code": <string>}; got '
                f"{turn.call.name!r} with {sorted(turn.call.arguments)}"
            )
        return tool_call_text(turn.content, code)


def parse_turn(text: str, truncated: bool) -> ModelTurn:
    """A turn ending in `<|/python|>` calls the python tool with the code after the last `<|python|>` (empty when
    there is none, as always); any other turn is an answer, `ended` when it ends in `<|end|>`."""
    if text.endswith(CALL_END) and not truncated:
        begin = text.rfind(CALL)
        code = text[begin + len(CALL) : -len(CALL_END)] if begin >= 0 else ""
        content = text[:begin] if begin >= 0 else text[: -len(CALL_END)]
        return ModelTurn(text, content, call=ToolCall("python", {"code": code}))
    ended = text.endswith(END) and not truncated
    return ModelTurn(text, text.removesuffix(END), ended=ended)
