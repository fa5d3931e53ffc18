"""The chat-format interface: how one model family writes prompts, tool calls, tool responses and the end of a
turn, as token ids (docs/design.md section 3, "Chat formats").

The agent runner, SFT and evaluation build every sequence through a `ChatFormat`, so what the trainer sees is
exactly the ids the engine sampled plus the ids the format appended for the environment (token in, token out),
never re-tokenised text. A format writes three kinds of text (the prompt, an assistant turn, a tool's output
with the bridge back to the next turn), each tokenised on its own; `render_trace` builds an SFT sequence from
the same pieces the runner uses, so SFT trains on the sequences rollouts produce.
"""

from __future__ import annotations

from typing import Any

from components.contracts.chat import ModelTurn, Prompt
from components.contracts.trace import Trace, Turn


class FormatError(ValueError):
    """A model directory whose chat format cannot be used: an unknown template, a missing token. Raised at start;
    the CLI prints it as one `sao: ...` line."""


class ChatFormat:
    """A chat format over one tokenizer. Subclasses write the three kinds of text; the ids are always the
    tokenizer's ids of those texts, each piece tokenised on its own (so no piece depends on its neighbours)."""

    name: str
    """`markers` or `hermes` (the names `model.chat_format` takes)."""
    tokenizer: Any
    """The model's tokenizer (a transformers fast tokenizer)."""
    stop_token_ids: tuple[int, ...]
    """Token ids that end a model turn (the engine stops there; the stop token is part of the turn)."""
    markup: tuple[str, ...]
    """The format's structural strings (turn, call, response, reasoning and end tags): text or code holding one
    would be read as structure (the data gate's `calls_balanced`)."""
    has_system: bool = True
    """The prompt carries a system prompt (`Prompt.system`); the marker format has none and drops it."""
    builtin_tools: tuple[str, ...] | None = None
    """The names of the only tools the format can call, when its prompt carries no tool schemas (the marker
    format: `python`, implied); None when the prompt renders the schemas it is given."""

    def prompt_text(self, prompt: Prompt) -> str:
        """What an episode starts from: system prompt and tool schemas where the format takes them, the user turn
        and the generation prompt."""
        raise NotImplementedError

    def observation_text(self, output: str) -> str:
        """What follows a turn that ended in a tool call: the tool's `output` as a tool response and the bridge
        back to the next assistant turn (its generation prompt)."""
        raise NotImplementedError

    def action_text(self, turn: Turn) -> str:
        """What a model writes for an assistant turn of a trace, its end token included (what SFT trains on and a
        well-trained policy samples)."""
        raise NotImplementedError

    def parse(self, text: str, truncated: bool) -> ModelTurn:
        """One sampled turn (decoded with its special tokens) as reasoning, content and a tool call or answer."""
        raise NotImplementedError

    def turn_text(self, turn: ModelTurn) -> str:
        """What a model writes for `turn`, its end token included: the inverse of `parse` (a chat request's
        earlier assistant messages, with any tool call). A call the format cannot write raises a ValueError."""
        raise NotImplementedError

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return encode(self.tokenizer, self.prompt_text(prompt))

    def observation_ids(self, output: str) -> list[int]:
        return encode(self.tokenizer, self.observation_text(output))


def encode(tokenizer, text: str) -> list[int]:
    """Ids of `text` with the special tokens it spells as single tokens and no BOS/EOS added."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def trace_segments(chat: ChatFormat, trace: Trace, tools: tuple[dict[str, Any], ...] = ()) -> list[tuple[str, bool]]:
    """`(text, is_action)` pieces of a trace in `chat`: the prompt (with `tools`), then each assistant turn's own
    text and each tool turn's observation text."""
    segments = [(chat.prompt_text(Prompt(trace.turns[0].content, tools=tools)), False)]
    for turn in trace.turns[1:]:
        if turn.role == "assistant":
            segments.append((chat.action_text(turn), True))
        else:
            segments.append((chat.observation_text(turn.content), False))
    return segments


def render_trace(chat: ChatFormat, trace: Trace, tools: tuple[dict[str, Any], ...] = ()) -> tuple[list[int], list[int]]:
    """Token ids and action mask of a trace: its segments tokenised one by one, exactly as the agent runner builds
    a trajectory (the assistant's pieces have mask 1)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, is_action in trace_segments(chat, trace, tools):
        piece = encode(chat.tokenizer, text)
        ids += piece
        mask += [int(is_action)] * len(piece)
    return ids, mask


def require_tokens(tokenizer, tokens: tuple[str, ...], fmt: str, where: str) -> dict[str, int]:
    """The ids of `tokens`, each a single token of `tokenizer`'s vocabulary; a FormatError names the first one
    that is missing."""
    vocab = tokenizer.get_vocab()
    for token in tokens:
        if token not in vocab:
            raise FormatError(f"{where}: the {fmt} chat format needs the token {token!r}, which the tokenizer lacks")
    return {token: vocab[token] for token in tokens}
