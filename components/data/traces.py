"""Rendering and storage of tool-integrated reasoning traces (`components.contracts.trace`).

A real teacher (GPT-OSS-120B behind an OpenAI-compatible endpoint) returns OpenAI chat messages with
`tool_calls`; `trace_from_openai_messages` parses those into the same `Trace`, so SFT sees one format. A trace
is rendered to tokens by the student's chat format (`components.chat.render_trace`): each segment tokenised on
its own and the ids concatenated, exactly as the agent loop builds a trajectory, so training never sees a
retokenised sequence that rollouts did not produce.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from components.contracts.trace import Trace, Turn


def trace_from_openai_messages(problem_id: str, messages: list[dict], answer: int | None) -> Trace:
    """Parse an OpenAI chat transcript (a real teacher's output) into a `Trace`.

    Assistant messages may carry `tool_calls` with a function named `python` whose JSON arguments hold
    `code`, and their reasoning as `reasoning_content` (vLLM's and DeepSeek's field) or `reasoning` (OpenAI's
    newer one): it is kept, and the student's chat format decides whether it has a channel for it. Tool messages
    carry the output. System messages are dropped (the student's prompt is its chat format's).
    """
    if not isinstance(messages, list):
        raise ValueError(f"messages: expected a list of chat messages, got {type(messages).__name__}")
    turns: list[Turn] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: expected an object, got {type(message).__name__}")
        role = message.get("role")
        if role == "system":
            continue
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string, got {type(content).__name__}")
        reasoning = (
            (message.get("reasoning_content") or message.get("reasoning") or None) if role == "assistant" else None
        )
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"messages[{i}].reasoning_content: expected a string, got {type(reasoning).__name__}")
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list) or len(calls) != 1 or not isinstance(calls[0], dict):
                raise ValueError(
                    f"messages[{i}].tool_calls: expected a list of exactly one call object, got {str(calls)[:60]}"
                )
            function = calls[0].get("function")
            if not isinstance(function, dict):
                raise ValueError(
                    f"messages[{i}].tool_calls[0].function: expected an object, got {type(function).__name__}"
                )
            if function.get("name") != "python":
                raise ValueError(
                    f"messages[{i}].tool_calls[0].function.name: expected 'python', got {function.get('name')!r}"
                )
            try:
                code = json.loads(function.get("arguments", "{}"))["code"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"messages[{i}].tool_calls[0].function.arguments: no JSON 'code' field") from exc
            if not isinstance(code, str):
                raise ValueError(
                    f"messages[{i}].tool_calls[0].function.arguments: 'code' must be a string, got "
                    f"{type(code).__name__}"
                )
            turns.append(Turn("assistant", content, code, reasoning))
        elif role in ("user", "assistant", "tool"):
            turns.append(Turn(role, content, reasoning=reasoning))
        else:
            raise ValueError(f"messages[{i}].role: unknown role {role!r}")
    return Trace(problem_id, tuple(turns), answer)


_SCHEMA = pa.schema(
    [
        ("problem_id", pa.string()),
        ("answer", pa.int64()),  # nullable: None for traces without an integer answer (style, coding)
        ("roles", pa.list_(pa.string())),
        ("contents", pa.list_(pa.string())),
        ("tool_codes", pa.list_(pa.string())),
        ("reasonings", pa.list_(pa.string())),  # optional on read: files written before it have no reasoning
    ]
)
_REQUIRED = _SCHEMA.names[:5]


def write_traces(path: str | Path, traces: list[Trace]) -> Path:
    """Write traces as Parquet (one row per trace, turns as parallel lists)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "problem_id": [t.problem_id for t in traces],
            "answer": [t.answer for t in traces],
            "roles": [[turn.role for turn in t.turns] for t in traces],
            "contents": [[turn.content for turn in t.turns] for t in traces],
            "tool_codes": [[turn.tool_code for turn in t.turns] for t in traces],
            "reasonings": [[turn.reasoning for turn in t.turns] for t in traces],
        },
        schema=_SCHEMA,
    )
    pq.write_table(table, path)
    return path


def trace_from_row(rec: Mapping[str, Any]) -> Trace:
    """A trace from its stored row: `problem_id`, `answer` and the turns as parallel lists `roles`, `contents`,
    `tool_codes` and optionally `reasonings`. A missing column, a value of the wrong type or a malformed conversation is a ValueError
    naming the field (and the turn's index)."""
    if not isinstance(rec, Mapping):
        raise ValueError(f"trace: expected an object with the columns {_SCHEMA.names}, got {type(rec).__name__}")
    missing = [name for name in _REQUIRED if name not in rec]
    if missing:
        raise ValueError(f"trace: missing field(s) {missing}")
    columns = {name: rec[name] for name in ("roles", "contents", "tool_codes")}
    columns["reasonings"] = rec.get("reasonings")
    if columns["reasonings"] is None and isinstance(columns["roles"], list):
        columns["reasonings"] = [None] * len(columns["roles"])
    for name, values in columns.items():
        if not isinstance(values, list):
            raise ValueError(f"trace {rec['problem_id']}: {name} must be a list, got {type(values).__name__}")
    n = len(columns["roles"])
    for name in ("contents", "tool_codes", "reasonings"):
        if len(columns[name]) != n:
            raise ValueError(f"trace {rec['problem_id']}: {name} has {len(columns[name])} entries, roles has {n}")
    turns = []
    for i, (role, content, code, reasoning) in enumerate(zip(*columns.values())):
        try:
            turns.append(Turn(role, content, code, reasoning))
        except ValueError as exc:
            raise ValueError(f"trace {rec['problem_id']}: turns[{i}].{exc}") from None
    return Trace(rec["problem_id"], tuple(turns), rec["answer"])


def read_traces(path: str | Path) -> list[Trace]:
    """Read and validate traces; an unreadable file or a malformed row fails naming the file, the row and the
    field."""
    where = f"{path}: " if isinstance(path, (str, Path)) else ""  # a file object: its caller names it
    try:
        table = pq.read_table(path)
    except pa.ArrowException as exc:
        raise ValueError(f"{where}not a readable Parquet file of traces: {exc}") from exc
    missing = set(_REQUIRED) - set(table.column_names)
    if missing:
        raise ValueError(f"{where}missing columns {sorted(missing)}")
    traces = []
    for row, rec in enumerate(table.to_pylist()):
        try:
            traces.append(trace_from_row(rec))
        except ValueError as exc:
            raise ValueError(f"{where}row {row}: {exc}") from exc
    return traces
