"""How the tool-using environments (`tir_math`, `coding`) treat a model turn's tool call.

A call the chat format could not parse (bad JSON, no closing tag) or that does not fit the episode's tools
(unknown tool, missing or mistyped argument) is malformed. By `env.malformed_calls` it becomes an observation
that tells the model what was wrong (`observe`, the default: the model can correct itself, and the turn costs
it a turn of its budget) or ends the episode unrewarded with finish reason `malformed_call` (`end`). Either way
the step is flagged, the runner counts it in the trajectory's `metadata["malformed_calls"]` and the loop in
`rollout/malformed_calls`; a malformed call never raises.
"""

from __future__ import annotations

import typing
from typing import Any

from components.config.fields import MalformedCalls
from components.contracts.chat import PYTHON_TOOL, ModelTurn, check_call
from components.contracts.environment import StepResult

MALFORMED_CALLS: tuple[str, ...] = typing.get_args(MalformedCalls)
TOOLS = (PYTHON_TOOL,)
"""The tools `tir_math` and `coding` offer: the python tool."""


def call_problem(turn: ModelTurn, tools: tuple[dict[str, Any], ...] = TOOLS) -> str | None:
    """What is wrong with the turn's tool call, or None (no call, or a well-formed one)."""
    if turn.call_error is not None:
        return turn.call_error
    return check_call(turn.call, tools) if turn.call is not None else None


def malformed_step(problem: str, mode: MalformedCalls, info: dict[str, Any]) -> StepResult:
    """The step after a malformed call: an error observation (`observe`) or the end of the episode (`end`)."""
    if mode == "end":
        return StepResult(None, True, 0.0, "malformed_call", {**info, "error": problem}, malformed=True)
    return StepResult(f"Error: {problem}\n", False, malformed=True)


def check_mode(mode: str) -> MalformedCalls:
    if mode not in MALFORMED_CALLS:
        raise ValueError(f"env.malformed_calls: must be one of {list(MALFORMED_CALLS)}, got {mode!r}")
    return mode  # type: ignore[return-value]
