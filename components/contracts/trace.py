"""A tool-integrated reasoning trace: the teacher's conversation that SFT imitates.

The user's question, assistant turns that may end in a Python tool call, tool turns carrying the call's
output, and a final assistant turn with the answer. `components.data.traces` renders traces to tokens and
stores them as Parquet; every teacher (programmatic or a real endpoint) produces this one type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["user", "assistant", "tool"]


@dataclass(frozen=True)
class Turn:
    role: Role
    """`user`, `assistant` or `tool`."""
    content: str
    """Text of the turn (for tool turns: the tool's output)."""
    tool_code: str | None = None
    """Python code of the tool call an assistant turn ends with; None for a final answer."""


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
        validate_turns(self.turns, self.problem_id)


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


