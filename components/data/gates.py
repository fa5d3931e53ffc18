"""Data gates: Great Expectations suites a dataset must pass before the pipeline trains on it.

Two gates, each over a frame of `components.data.gate_frames` (one row per record, derived columns):

- `check_traces`: distilled TIR traces. Schema (the frame's columns, the types of the scalar Parquet
  columns), a non-empty final answer whose `\\boxed{}` grades correct (when the trace has an integer
  answer), tool-call markers balanced in the rendered assistant text, rendered token count within bounds,
  unique problem ids.
- `check_rollouts`: rollout logs (the trajectory contract, docs/design.md section 5). Schema, a finite reward in
  range, action mask well formed, log-probs and versions on exactly the action tokens, versions
  non-decreasing, token count within bounds, a known finish reason.

Every gate fails on an empty dataset. The result is a `GateReport`: a Markdown table for a Prefect
artifact, a JSON-ready dict to store beside the dataset, and `raise_if_failed()`, whose `GateFailed` names
each failing expectation, its column and the first offending rows.

Great Expectations is imported on first validation only (the import takes ~4 s, and this package is
imported everywhere). Its ephemeral context needs no project folder; a fresh one per validation costs
~10 ms and keeps gates independent. Thresholds are arguments, never config objects.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from components.chat import ChatFormat
from components.contracts.trace import Trace
from components.contracts.trajectory import FINISH_REASONS, Trajectory
from components.data.gate_frames import (
    ROLLOUT_FRAME_COLUMNS,
    TRACE_FRAME_COLUMNS,
    Grader,
    rollout_frame,
    trace_frame,
)

Expectations = list[tuple[str, dict[str, Any]]]
"""A suite as data: (Great Expectations class name, its keyword arguments), in report order."""

_RESULT_FORMAT = {"result_format": "COMPLETE", "return_unexpected_index_query": False}
"""COMPLETE returns `unexpected_index_list`: the frame index of every offending row."""


class GateFailed(ValueError):
    """A dataset failed its gate; `report` holds the full `GateReport`."""

    def __init__(self, report: GateReport) -> None:
        super().__init__(report.failure_message())
        self.report = report


@dataclass(frozen=True)
class OffendingRow:
    index: int
    """Row of the frame (the record's position in the dataset)."""
    id: Any
    """The record's id (problem_id, prompt_id)."""
    value: Any
    """The value that failed, JSON-ready (non-finite floats as strings)."""


@dataclass(frozen=True)
class ExpectationResult:
    expectation: str
    """Expectation type, e.g. `expect_column_values_to_be_between`."""
    column: str | None
    """The column checked; None for table-level expectations."""
    kwargs: dict[str, Any]
    """The expectation's arguments other than the column."""
    success: bool
    """Whether the expectation held."""
    unexpected_count: int
    """Rows that failed it (0 for a table-level expectation)."""
    unexpected_percent: float | None
    """Percent of non-null values that failed; None for an empty frame or a table expectation."""
    observed_value: Any
    """What a table-level expectation saw (row count, column list); None for column expectations."""
    details: Any
    """Great Expectations' details (e.g. the missing and unexpected columns), if any."""
    rows: tuple[OffendingRow, ...]
    """The first offending rows, by index."""
    error: str | None = None
    """The exception Great Expectations raised while checking, if any (the expectation then fails)."""

    @property
    def name(self) -> str:
        """`expectation(column)`, or the expectation alone for a table-level one."""
        return f"{self.expectation}({self.column})" if self.column else self.expectation


@dataclass(frozen=True)
class GateReport:
    gate: str
    """Gate name (`traces`, `rollouts`)."""
    success: bool
    row_count: int
    results: tuple[ExpectationResult, ...]
    """One per expectation, in suite order."""

    @property
    def failures(self) -> tuple[ExpectationResult, ...]:
        return tuple(r for r in self.results if not r.success)

    def summary(self) -> str:
        """One line: the verdict, counts, and the failing expectations."""
        if self.success:
            return f"data gate {self.gate}: passed {len(self.results)} expectations on {_rows(self.row_count)}"
        failed = "; ".join(f"{r.name}: {_what_failed(r)}" for r in self.failures)
        return (
            f"data gate {self.gate}: FAILED {len(self.failures)} of {len(self.results)} expectations on "
            f"{_rows(self.row_count)}: {failed}"
        )

    def markdown(self) -> str:
        """A table with one line per expectation and a pass/fail mark, then the first offending rows of each
        failure (for a Prefect Markdown artifact)."""
        lines = [
            f"### Data gate `{self.gate}`: {'passed' if self.success else 'FAILED'}",
            "",
            f"{_rows(self.row_count)}, {len(self.failures)} of {len(self.results)} expectations failed.",
            "",
            "| | expectation | column | unexpected | first offending ids |",
            "|---|---|---|---|---|",
        ]
        for r in self.results:
            ids = ", ".join(_cell(row.id) for row in r.rows)
            lines.append(
                f"| {'✅' if r.success else '❌'} | {r.expectation} | {_cell(r.column or '')} | "
                f"{r.unexpected_count} | {ids} |"
            )
        for r in self.failures:
            lines += ["", f"**{_cell(r.name)}**: {_what_failed(r)}"]
            if r.rows:
                lines += ["", "| row | id | value |", "|---|---|---|"]
                lines += [f"| {row.index} | {_cell(row.id)} | {_cell(row.value)} |" for row in r.rows]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable (also with `allow_nan=False`): to store next to the dataset."""
        return asdict(self)

    def failure_message(self) -> str:
        """Every failing expectation with its column and first offending rows; '' when the gate passed."""
        if self.success:
            return ""
        lines = [
            f"data gate {self.gate} failed {len(self.failures)} of {len(self.results)} expectations "
            f"on {_rows(self.row_count)}:"
        ]
        for r in self.failures:
            rows = ", ".join(f"row {row.index} id={row.id!r} value={_clip(repr(row.value))}" for row in r.rows)
            lines.append(f"- {r.name}: {_what_failed(r)}" + (f"; first: {rows}" if rows else ""))
        return "\n".join(lines)

    def raise_if_failed(self) -> GateReport:
        """The report itself when the gate passed; GateFailed otherwise."""
        if not self.success:
            raise GateFailed(self)
        return self


def trace_expectations(max_tokens: int, min_tokens: int = 1) -> Expectations:
    """The traces suite over `trace_frame`'s columns."""
    _check_bounds(min_tokens, max_tokens)
    return [
        ("ExpectTableRowCountToBeBetween", {"min_value": 1}),
        ("ExpectTableColumnsToMatchSet", {"column_set": list(TRACE_FRAME_COLUMNS), "exact_match": True}),
        ("ExpectColumnValuesToNotBeNull", {"column": "problem_id"}),
        ("ExpectColumnValuesToBeOfType", {"column": "problem_id", "type_": "str"}),
        ("ExpectColumnValuesToBeUnique", {"column": "problem_id"}),
        ("ExpectColumnValuesToBeOfType", {"column": "answer", "type_": "int"}),  # nulls (no answer) pass
        ("ExpectColumnValuesToNotBeNull", {"column": "final_answer"}),
        ("ExpectColumnValuesToBeInSet", {"column": "answer_correct", "value_set": [True]}),
        ("ExpectColumnValuesToBeInSet", {"column": "calls_balanced", "value_set": [True]}),
        ("ExpectColumnValuesToBeBetween", {"column": "n_tokens", "min_value": min_tokens, "max_value": max_tokens}),
    ]


def rollout_expectations(
    max_tokens: int, reward_range: tuple[float, float] = (0.0, 1.0), min_tokens: int = 1
) -> Expectations:
    """The rollouts suite over `rollout_frame`'s columns."""
    _check_bounds(min_tokens, max_tokens)
    low, high = reward_range
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ValueError(f"reward_range must be finite (low, high) with low <= high, got {reward_range}")
    return [
        ("ExpectTableRowCountToBeBetween", {"min_value": 1}),
        ("ExpectTableColumnsToMatchSet", {"column_set": list(ROLLOUT_FRAME_COLUMNS), "exact_match": True}),
        ("ExpectColumnValuesToNotBeNull", {"column": "prompt_id"}),
        ("ExpectColumnValuesToBeOfType", {"column": "prompt_id", "type_": "str"}),
        ("ExpectColumnValuesToBeOfType", {"column": "env", "type_": "str"}),
        ("ExpectColumnValuesToNotBeNull", {"column": "reward"}),  # a NaN reward is null to pandas
        ("ExpectColumnValuesToBeBetween", {"column": "reward", "min_value": low, "max_value": high}),
        ("ExpectColumnValuesToNotBeNull", {"column": "finish_reason"}),  # InSet skips nulls
        ("ExpectColumnValuesToBeInSet", {"column": "finish_reason", "value_set": list(FINISH_REASONS)}),
        ("ExpectColumnValuesToBeInSet", {"column": "action_mask_valid", "value_set": [True]}),
        ("ExpectColumnValuesToBeInSet", {"column": "logprobs_complete", "value_set": [True]}),
        ("ExpectColumnValuesToBeInSet", {"column": "versions_complete", "value_set": [True]}),
        ("ExpectColumnValuesToBeInSet", {"column": "versions_monotone", "value_set": [True]}),
        ("ExpectColumnValuesToBeBetween", {"column": "n_tokens", "min_value": min_tokens, "max_value": max_tokens}),
    ]


def check_traces(
    traces: Sequence[Trace],
    chat: ChatFormat,
    max_tokens: int,
    min_tokens: int = 1,
    *,
    grade: Grader,
    tools: tuple[dict[str, Any], ...] = (),
    max_rows: int = 5,
) -> GateReport:
    """Gate distilled traces. `chat` renders them (the student's chat format over a fast HF tokenizer) with the
    environment's `tools`, `max_tokens` is the rollout budget (`rollout.max_total_tokens`), `grade` grades a final
    answer (`envs.grading.grade_answer`; passed in because `envs` imports `data`). Reports the first `max_rows`
    offending rows of each expectation."""
    frame = trace_frame(traces, chat, grade, tools)
    return validate_frame(frame, "traces", trace_expectations(max_tokens, min_tokens), "problem_id", max_rows)


def check_rollouts(
    trajectories: Sequence[Trajectory],
    max_tokens: int,
    reward_range: tuple[float, float] = (0.0, 1.0),
    min_tokens: int = 1,
    *,
    max_rows: int = 5,
) -> GateReport:
    """Gate rollout logs against the trajectory contract; `reward_range` is inclusive."""
    expectations = rollout_expectations(max_tokens, reward_range, min_tokens)
    return validate_frame(rollout_frame(trajectories), "rollouts", expectations, "prompt_id", max_rows)


def validate_frame(
    frame: pd.DataFrame, gate: str, expectations: Expectations, id_column: str, max_rows: int = 5
) -> GateReport:
    """Run `expectations` over `frame` in an ephemeral Great Expectations context. `frame` must have a
    default RangeIndex (offending rows are reported by position) and an `id_column`."""
    if id_column not in frame.columns:
        raise ValueError(f"id_column: {id_column!r} is not a column of the frame ({list(frame.columns)})")
    if not isinstance(frame.index, pd.RangeIndex) or frame.index.start != 0 or frame.index.step != 1:
        raise ValueError("frame: needs a default RangeIndex (use frame.reset_index(drop=True))")
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = (
        context.data_sources.add_pandas(gate)
        .add_dataframe_asset(gate)
        .add_batch_definition_whole_dataframe(gate)
        .get_batch(batch_parameters={"dataframe": frame})
    )
    # Great Expectations reorders results (table-level first); `meta.position` restores suite order.
    suite = gx.ExpectationSuite(
        name=gate,
        expectations=[
            getattr(gxe, name)(**kwargs, meta={"position": i}) for i, (name, kwargs) in enumerate(expectations)
        ],
    )
    outcome = batch.validate(suite, result_format=_RESULT_FORMAT)
    ordered = sorted(outcome.results, key=lambda r: r.expectation_config.meta["position"])
    results = tuple(_result(r, frame, id_column, max_rows) for r in ordered)
    return GateReport(gate, all(r.success for r in results), len(frame), results)


def _check_bounds(min_tokens: int, max_tokens: int) -> None:
    if not 0 <= min_tokens <= max_tokens:
        raise ValueError(
            f"token bounds need 0 <= min_tokens <= max_tokens, got min_tokens={min_tokens}, max_tokens={max_tokens}"
        )


def _result(validation, frame: pd.DataFrame, id_column: str, max_rows: int) -> ExpectationResult:
    """An `ExpectationResult` from one Great Expectations validation result."""
    config = validation.expectation_config
    column = config.kwargs.get("column")
    found = validation.result or {}
    indices = sorted(int(i) for i in found.get("unexpected_index_list") or [])[:max_rows]
    rows = tuple(OffendingRow(i, _plain(frame.at[i, id_column]), _plain(frame.at[i, column])) for i in indices)
    return ExpectationResult(
        expectation=config.type,
        column=column,
        kwargs={k: _plain(v) for k, v in config.kwargs.items() if k not in ("batch_id", "column")},
        success=bool(validation.success),
        unexpected_count=int(found.get("unexpected_count") or 0),
        unexpected_percent=_plain(found.get("unexpected_percent")),
        observed_value=_plain(found.get("observed_value")),
        details=_plain(found.get("details")),
        rows=rows,
        error=_error(validation.exception_info or {}),
    )


def _error(info: dict) -> str | None:
    """The exception messages of a result: `exception_info` is flat, or keyed by metric when a metric raised."""
    entries = [info] if "raised_exception" in info else list(info.values())
    messages = [e.get("exception_message") or "" for e in entries if isinstance(e, dict) and e.get("raised_exception")]
    return "; ".join(messages) if messages else None


def _what_failed(r: ExpectationResult) -> str:
    """`3 rows (1.5%)`, the observed value of a table expectation, or the error."""
    if r.error:
        return f"error: {r.error}"
    if r.column is None:
        return f"observed {r.observed_value!r}" + (f", {r.details!r}" if r.details else "")
    percent = "" if r.unexpected_percent is None else f" ({r.unexpected_percent:.3g}%)"
    return f"{_rows(r.unexpected_count)}{percent}"


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _plain(value: Any) -> Any:
    """A JSON-ready copy: numpy scalars to Python, non-finite floats to strings, containers recursively."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def _clip(text: str, width: int = 60) -> str:
    """`text`, cut to `width` characters."""
    return text if len(text) <= width else text[: width - 1] + "…"


def _cell(value: Any) -> str:
    """A Markdown table cell: long text cut, pipes escaped, newlines shown as `\\n`."""
    text = _clip(value if isinstance(value, str) else repr(value))
    return text.replace("|", "\\|").replace("\n", "\\n")
