"""Chat formats: how a model family writes prompts, tool calls and tool responses as token ids
(components/chat/format.py). `chat_format(tokenizer)` picks the format a model directory's tokenizer defines:

- `markers`: the project's own special-token markers (the embedded `tiny-cpu` default);
- `hermes`: Hermes-style `<tool_call>` JSON in a ChatML template, as Qwen3 and Qwen2.5 use it.

Everything the format needs is checked when it is built, so a model directory that cannot be used is refused
at start with a `FormatError` naming what is missing.
"""

from __future__ import annotations

from components.chat.format import ChatFormat, FormatError, encode, render_trace, trace_segments
from components.chat.hermes import HermesFormat, is_hermes_template
from components.chat.markers import TOKENS as MARKER_TOKENS
from components.chat.markers import MarkerFormat

FORMATS = ("auto", "markers", "hermes")
"""The values of `model.chat_format`."""


def chat_format(tokenizer, name: str = "auto", where: str = "the tokenizer") -> ChatFormat:
    """The chat format `name` over `tokenizer`; `auto` detects it: the markers when the vocabulary has all of
    them, Hermes when the chat template writes `<tool_call>` and `<tool_response>`. `where` names the model
    directory in errors."""
    if name == "markers":
        return MarkerFormat(tokenizer, where)
    if name == "hermes":
        return HermesFormat(tokenizer, where)
    if name != "auto":
        raise FormatError(f"model.chat_format: must be one of {list(FORMATS)}, got {name!r}")
    vocab = tokenizer.get_vocab()
    if all(token in vocab for token in MARKER_TOKENS):
        return MarkerFormat(tokenizer, where)
    if is_hermes_template(getattr(tokenizer, "chat_template", None)):
        return HermesFormat(tokenizer, where)
    has_template = (
        "has a chat template that" if getattr(tokenizer, "chat_template", None) else "has no chat template and"
    )
    raise FormatError(
        f"{where}: cannot tell the chat format: the tokenizer {has_template} is neither the marker format "
        f"(tokens {list(MARKER_TOKENS)}) nor a Hermes tool-call template (<tool_call>, <tool_response>); "
        "set model.chat_format"
    )


__all__ = [
    "FORMATS",
    "ChatFormat",
    "FormatError",
    "HermesFormat",
    "MarkerFormat",
    "chat_format",
    "encode",
    "render_trace",
    "trace_segments",
]
