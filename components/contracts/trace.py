"""A tool-integrated reasoning trace: the teacher's conversation that SFT imitates.

The user's question, assistant turns that may end in a Python tool call, tool turns carrying the call's
output, and a final assistant turn with the answer. `components.data.traces` renders traces to tokens and
stores them as Parquet; every teacher (programmatic or a real endpoint) produces this one type.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

Role = Literal["user", "assistant", "tool"]
ROLES: tuple[str, ...] = typing.get_args(Role)


@dataclass(frozen=True)
class Turn:
    role: Role
    """`user`, `assistant` or `tool`."""
    content: str
    """Text of the turn (for tool turns: the tool's output)."""
    tool_code: str | None = None
    """Python code of the tool call an assistant turn ends with; None for a final answer."""
    reasoning: str | None = None
    """An assistant turn's reasoning (a Thinking model's `<think>` block); None when it has none. Kept in SFT
    sequences by chat formats with a reasoning channel (`hermes`), dropped by the marker format."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {list(ROLES)}, got {_clip(self.role)}")
        if not isinstance(self.content, str):
            raise ValueError(f"content: must be a string, got {_clip(self.content)}")
        if self.tool_code is not None and not isinstance(self.tool_code, str):
            raise ValueError(f"tool_code: must be a string or None, got {_clip(self.tool_code)}")
        if self.reasoning is not None and (not isinstance(self.reasoning, str) or self.role != "assistant"):
            raise ValueError(f"reasoning: must be a string on an assistant turn or None, got {_clip(self.reasoning)}")


@dataclass(frozen=True)
class Trace:
    problem_id: str
    """Id of the problem the trace solves."""
    turns: tuple[Turn, ...]
    """user, then alternating assistant/tool turns, ending with an assistant turn without a tool call."""
    answer: int | None
    """The reference integer answer of the problem (for grading and filtering); None for environments
    without one (style answers are judged, coding answers are graded by hidden tests)."""

    def __post_init__(self) -> None:
        if not isinstance(self.problem_id, str) or not self.problem_id:
            raise ValueError(f"trace: problem_id must be a non-empty string, got {_clip(self.problem_id)}")
        if not isinstance(self.turns, tuple) or not all(isinstance(t, Turn) for t in self.turns):
            raise ValueError(f"trace {self.problem_id}: turns must be a tuple of Turn, got {_clip(self.turns)}")
        if self.answer is not None and (not isinstance(self.answer, int) or isinstance(self.answer, bool)):
            raise ValueError(f"trace {self.problem_id}: answer must be an integer or None, got {_clip(self.answer)}")
        validate_turns(self.turns, self.problem_id)


def _clip(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def validate_turns(turns: tuple[Turn, ...], where: str) -> None:
    """Structural checks of a trace; the message names the turn index and field."""
    if not turns or turns[0].role != "user":
        raise ValueError(f"trace {where}: turns[0].role must be 'user'")
    for i, turn in enumerate(turns[1:], start=1):
        expected = "assistant" if i % 2 == 1 else "tool"
        if turn.role != expected:
            raise ValueError(f"trace {where}: turns[{i}].role must be {expected!r}, got {turn.role!r}")
        if turn.role == "tool" and turns[i - 1].tool_code is None:
            raise ValueError(f"trace {where}: turns[{i}] is a tool turn but turns[{i - 1}] made no tool call")
    last = turns[-1]
    if last.role != "assistant" or last.tool_code is not None:
        raise ValueError(f"trace {where}: the last turn must be an assistant answer without a tool call")
