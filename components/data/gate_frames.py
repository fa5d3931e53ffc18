"""The frames the data gates validate: one row per trace or trajectory, with derived columns.

Plain Python and pandas, no Great Expectations: every derived column is a small function of one record, so
it is tested on hand-built records (`components.data.gates` runs the expectations over the frame).

A frame holds the dataset's scalar Parquet columns (`write_traces`, `write_trajectories`) and the derived
columns. The list-valued ones (turns, per-token lists) enter only through derived columns: Great
Expectations fingerprints a frame by pickling it when a column holds lists, twice per validation, which
cost 1.2 s at 20,000 trajectories of 120 tokens against 0.07 s for the scalar frame. A bool column is True
when the record is fine; a derived column is None where its check does not apply (a trace without an
integer answer has no `answer_correct`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from itertools import compress, islice
from operator import le
from typing import Any

import pandas as pd

from components.chat import ChatFormat, trace_segments
from components.contracts.trace import Trace, Turn
from components.contracts.trajectory import Trajectory

TRACE_COLUMNS = ("problem_id", "answer")
"""The scalar Parquet columns of `write_traces`; its list columns are roles, contents and tool_codes."""
TRACE_DERIVED = ("final_answer", "answer_correct", "calls_balanced", "n_tokens")
TRACE_FRAME_COLUMNS = TRACE_COLUMNS + TRACE_DERIVED

ROLLOUT_COLUMNS = ("prompt_id", "env", "reward", "turns", "finish_reason", "prompt_len")
"""The scalar Parquet columns of `write_trajectories`; the others are the per-token lists, `timings`, `metadata` and
`routes`."""
ROLLOUT_DERIVED = ("n_tokens", "action_mask_valid", "logprobs_complete", "versions_complete", "versions_monotone")
ROLLOUT_FRAME_COLUMNS = ROLLOUT_COLUMNS + ROLLOUT_DERIVED

LOGPROB_TOLERANCE = 1e-6
"""A log-prob may exceed 0 by float rounding; the same tolerance as `Trajectory.validate`."""

Grader = Callable[[str, int], bool]
"""`grade(final answer text, reference integer) -> correct`, e.g. `components.envs.grading.grade_answer`."""


# ---- traces -------------------------------------------------------------------------------------------


def final_answer(trace: Trace) -> str | None:
    """The last assistant turn's text, None when it is empty or only whitespace."""
    content = trace.turns[-1].content
    return content if content.strip() else None


def answer_correct(trace: Trace, grade: Grader) -> bool | None:
    """Whether the final answer's `\\boxed{}` grades as the trace's integer answer; None without one."""
    if trace.answer is None:
        return None
    return bool(grade(trace.turns[-1].content, trace.answer))


def calls_balanced(trace: Trace, chat: ChatFormat) -> bool:
    """Whether every assistant turn, rendered in `chat`, reads back as what it is: its markup (`chat.markup`: the
    call, response, reasoning and end tags) exactly that of a plain turn of its kind, and its parse a call with its
    own code when a tool turn follows, else an answer. Markup inside the text or code breaks this
    (`print('<|/python|>')` in the marker format, a `</tool_call>` or `<|im_end|>` in Hermes): the tokenizer makes
    it a special token, and the engine would stop or parse there, so the policy could never produce the trace."""
    turns = trace.turns
    for i, turn in enumerate(turns):
        if turn.role != "assistant":
            continue
        answered = i + 1 < len(turns) and turns[i + 1].role == "tool"
        text = chat.action_text(turn)
        plain = _plain_markup(chat, bool(turn.content), answered, bool(turn.reasoning))
        if tuple(text.count(mark) for mark in chat.markup) != plain:
            return False
        parsed = chat.parse(text, truncated=False)
        if answered and (parsed.call is None or parsed.call.arguments.get("code") != turn.tool_code):
            return False
        if not answered and not parsed.is_final:
            return False
    return True


@functools.lru_cache(maxsize=64)
def _plain_markup(chat: ChatFormat, content: bool, answered: bool, reasoning: bool) -> tuple[int, ...]:
    """How often each of `chat.markup` occurs in a plain assistant turn of this kind (rendered once per kind)."""
    turn = Turn("assistant", "x" if content else "", "x" if answered else None, "x" if reasoning else None)
    text = chat.action_text(turn)
    return tuple(text.count(mark) for mark in chat.markup)


def token_counts(traces: Sequence[Trace], chat: ChatFormat, tools: tuple[dict[str, Any], ...] = ()) -> list[int]:
    """Rendered token count of each trace: `len(render_trace(chat, trace, tools)[0])`, in one batch.

    Segments are tokenised on their own, as `render_trace` does, but in one `encode_batch_fast` call of the
    Rust tokenizer: one `tokenizer(...)` call per segment costs ~0.4 ms per trace (8 s for 20,000 traces),
    the batch ~2 s. The format's tokenizer must be a fast (Rust-backed) Hugging Face tokenizer.
    """
    tokenizer = getattr(chat, "tokenizer", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"tokenizer: the gate needs a fast tokenizer with a backend_tokenizer, got {type(tokenizer).__name__}"
        )
    per_trace = [[text for text, _ in trace_segments(chat, t, tools)] for t in traces]
    encodings = backend.encode_batch_fast([text for texts in per_trace for text in texts], add_special_tokens=False)
    lengths = iter([len(e) for e in encodings])
    return [sum(islice(lengths, len(texts))) for texts in per_trace]


def trace_frame(
    traces: Sequence[Trace], chat: ChatFormat, grade: Grader, tools: tuple[dict[str, Any], ...] = ()
) -> pd.DataFrame:
    """One row per trace: `TRACE_COLUMNS` and `TRACE_DERIVED`, in that order; rendered in `chat` with `tools`."""
    columns = {
        "problem_id": [t.problem_id for t in traces],
        "answer": [t.answer for t in traces],
        "final_answer": [final_answer(t) for t in traces],
        "answer_correct": [answer_correct(t, grade) for t in traces],
        "calls_balanced": [calls_balanced(t, chat) for t in traces],
        "n_tokens": token_counts(traces, chat, tools),
    }
    return _frame(columns, {"n_tokens": "int64"})


# ---- rollouts -----------------------------------------------------------------------------------------


def action_mask_valid(t: Trajectory) -> bool:
    """`action_mask` has one 0/1 entry per token and no 1 inside the prompt."""
    mask = t.action_mask
    return len(mask) == len(t.token_ids) and set(mask) <= {0, 1} and not any(mask[: t.prompt_len])


# The per-token checks below iterate in C where they can (compress, map, list.count): with a Python loop per
# token the frame of 20,000 trajectories of 512 tokens took 4.7 s, now ~2.5 s.


def logprobs_complete(t: Trajectory) -> bool:
    """A finite log-prob <= 0 (up to `LOGPROB_TOLERANCE`) on every action token and None on every other."""
    return _on_actions_only(
        t.rollout_logprobs,
        t.action_mask,
        lambda actions: all(map(math.isfinite, actions)) and max(actions, default=0.0) <= LOGPROB_TOLERANCE,
    )


def versions_complete(t: Trajectory) -> bool:
    """A policy version on every action token and None on every other."""
    return _on_actions_only(t.versions, t.action_mask, lambda actions: True)


def versions_monotone(t: Trajectory) -> bool:
    """The versions present never decrease along the trajectory (weights only move forward mid-episode)."""
    present = [v for v in t.versions if v is not None]
    return all(map(le, present, present[1:]))


def _on_actions_only(values: list, mask: list[int], valid: Callable[[list], bool]) -> bool:
    """`values` has an entry per token, not None exactly on action tokens, and the action entries are `valid`."""
    if len(values) != len(mask):
        return False
    actions = list(compress(values, mask))
    # No None among the actions, so every None is off them; there must be one per non-action token.
    return None not in actions and values.count(None) == len(values) - len(actions) and valid(actions)


def rollout_frame(trajectories: Sequence[Trajectory]) -> pd.DataFrame:
    """One row per trajectory: `ROLLOUT_COLUMNS` and `ROLLOUT_DERIVED`, in that order."""
    columns = {name: [getattr(t, name) for t in trajectories] for name in ROLLOUT_COLUMNS}
    columns.update(
        {
            "n_tokens": [len(t.token_ids) for t in trajectories],
            "action_mask_valid": [action_mask_valid(t) for t in trajectories],
            "logprobs_complete": [logprobs_complete(t) for t in trajectories],
            "versions_complete": [versions_complete(t) for t in trajectories],
            "versions_monotone": [versions_monotone(t) for t in trajectories],
        }
    )
    return _frame(columns, {"n_tokens": "int64", "reward": "float64"})


def _frame(columns: dict[str, list], dtypes: dict[str, str]) -> pd.DataFrame:
    """A frame whose columns keep their Python values (object dtype: an int answer beside None stays an int,
    not a float NaN), except those named in `dtypes`; an empty input still has every column."""
    return pd.DataFrame({name: pd.Series(values, dtype=dtypes.get(name, object)) for name, values in columns.items()})
