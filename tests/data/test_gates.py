"""Data gates: the derived columns on hand-built records, and the Great Expectations suites on good and bad
traces and rollouts (each bad record named by the expectation it breaks and its row id).

Great Expectations is imported once for the whole file (the first validation pays ~4 s)."""

import ast
import dataclasses
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from components.chat import MarkerFormat, render_trace
from components.contracts.trace import Trace, Turn
from components.contracts.trajectory import Timings, Trajectory, read_trajectories, write_trajectories
from components.data import gate_frames, gates
from components.data.gate_frames import (
    ROLLOUT_COLUMNS,
    ROLLOUT_FRAME_COLUMNS,
    TRACE_COLUMNS,
    TRACE_FRAME_COLUMNS,
    action_mask_valid,
    answer_correct,
    calls_balanced,
    final_answer,
    logprobs_complete,
    rollout_frame,
    token_counts,
    trace_frame,
    versions_complete,
    versions_monotone,
)
from components.data.gates import GateFailed, check_rollouts, check_traces, rollout_expectations, validate_frame
from components.data.tasks import generate_problems
from components.data.teacher import teacher_trace
from components.data.traces import write_traces
from components.envs.grading import grade_answer
from components.models import build_tokenizer

USER = Turn("user", "Compute 3+4.")


@pytest.fixture(scope="module")
def chat():
    return MarkerFormat(build_tokenizer())


@pytest.fixture(scope="module")
def good_traces():
    """Teacher traces (with mental_max=700 some answer directly, the rest call the tool once or twice) and a
    trace without an integer answer, as a style environment writes."""
    problems = generate_problems(("affine", "two_step"), 30, seed=0, operand_max=99, split="train")
    style = Trace("style-0", (Turn("user", "Write a haiku."), Turn("assistant", "Old pond, a frog jumps.")), None)
    return [teacher_trace(p, mental_max=700) for p in problems] + [style]


def trajectory(prompt_id: str, **changes) -> Trajectory:
    """A valid 9-token episode: prompt (3), action (2), observation (2), action (2); the weights moved from
    version 0 to 1 between the two turns."""
    t = Trajectory(
        prompt_id=prompt_id,
        env="tir_math",
        token_ids=[9, 10, 11, 12, 13, 14, 15, 16, 17],
        action_mask=[0, 0, 0, 1, 1, 0, 0, 1, 1],
        rollout_logprobs=[None, None, None, -0.1, -0.2, None, None, -0.3, -0.4],
        versions=[None, None, None, 0, 0, None, None, 1, 1],
        reward=1.0,
        turns=2,
        finish_reason="stop",
        prompt_len=3,
        timings=Timings(queued=0.0),
    )
    return dataclasses.replace(t, **changes)


def failures(report):
    """{expectation(column): [(row, id), ...]} of the failing expectations."""
    return {r.name: [(row.index, row.id) for row in r.rows] for r in report.failures}


# ---- derived columns on hand-built records --------------------------------------------------------------


def test_final_answer_and_grading():
    assert final_answer(Trace("a", (USER, Turn("assistant", " \n ")), 7)) is None  # whitespace only
    assert final_answer(Trace("a", (USER, Turn("assistant", "\\boxed{7}")), 7)) == "\\boxed{7}"
    assert answer_correct(Trace("a", (USER, Turn("assistant", "so \\boxed{ 7 }")), 7), grade_answer) is True
    assert answer_correct(Trace("a", (USER, Turn("assistant", "7")), 7), grade_answer) is False  # no \boxed{}
    assert answer_correct(Trace("a", (USER, Turn("assistant", "\\boxed{8}")), 7), grade_answer) is False
    assert answer_correct(Trace("a", (USER, Turn("assistant", "")), None), grade_answer) is None  # nothing to grade


def _call(content: str, code: str, answer: str = "\\boxed{7}") -> Trace:
    return Trace("c", (USER, Turn("assistant", content, code), Turn("tool", "7\n"), Turn("assistant", answer)), 7)


@pytest.mark.parametrize(
    "trace, balanced",
    [
        (_call("", "print(3+4)"), True),  # <|python|> ... <|/python|>, then the tool turn
        (Trace("c", (USER, Turn("assistant", "\\boxed{7}")), 7), True),  # no call at all
        (_call("", "print('<|/python|>')"), False),  # opener, closer, closer: a closer without an opener
        (_call("use <|python|>", "print(3+4)"), False),  # opener, opener, closer: nested
        (_call("<|python|>x<|/python|>", "print(3+4)"), False),  # two calls in one turn: the first gets no output
        (_call("", "print(3+4)", answer="\\boxed{7}<|python|>"), False),  # an opener never closed
        (
            _call("", "print(3+4)", answer="<|python|>print(1)<|/python|>\\boxed{7}"),
            False,
        ),  # a call without a tool turn
    ],
)
def test_calls_balanced(trace, balanced, chat):
    assert calls_balanced(trace, chat) is balanced


def test_token_counts_by_hand_and_as_render_trace(chat, good_traces):
    trace = Trace(
        "t", (Turn("user", "Hi"), Turn("assistant", "", "1"), Turn("tool", "1\n"), Turn("assistant", "\\boxed{1}")), 1
    )
    # One token per character, one per marker: <|user|>Hi<|assistant|> = 4, <|python|>1<|/python|> = 3,
    # <|output|>1\n<|/output|> = 4, \boxed{1}<|end|> = 9 + 1 = 10; 4 + 3 + 4 + 10 = 21.
    assert token_counts([trace], chat) == [21]
    assert token_counts(good_traces, chat) == [len(render_trace(chat, t)[0]) for t in good_traces]
    assert token_counts([], chat) == []
    with pytest.raises(ValueError, match="tokenizer"):
        token_counts([trace], object())


def test_trace_frame_columns_and_values(chat):
    traces = [_call("", "print(3+4)"), Trace("s", (USER, Turn("assistant", "seven")), None)]
    frame = trace_frame(traces, chat, grade_answer)
    assert tuple(frame.columns) == TRACE_FRAME_COLUMNS
    # answer stays a Python int beside None (object column, not float NaN); the style trace has no grade.
    assert frame["answer"].tolist() == [7, None] and type(frame.at[0, "answer"]) is int
    assert frame["answer_correct"].tolist() == [True, None]
    # <|user|>Compute 3+4.<|assistant|> = 14, <|python|>print(3+4)<|/python|> = 12,
    # <|output|>7\n<|/output|> = 4, \boxed{7}<|end|> = 10: 40. The second: 14 + len("seven<|end|>") = 14 + 6.
    assert frame["n_tokens"].tolist() == [40, 20]


def test_rollout_columns_by_hand():
    good = trajectory("p")
    assert (action_mask_valid(good), logprobs_complete(good), versions_complete(good), versions_monotone(good)) == (
        True,
        True,
        True,
        True,
    )
    lps = good.rollout_logprobs
    assert not logprobs_complete(trajectory("p", rollout_logprobs=lps[:4] + [None] + lps[5:]))  # action 4 has none
    assert not logprobs_complete(trajectory("p", rollout_logprobs=lps[:5] + [-0.5] + lps[6:]))  # observation 5 has one
    assert not logprobs_complete(trajectory("p", rollout_logprobs=lps[:3] + [math.nan] + lps[4:]))
    assert not logprobs_complete(trajectory("p", rollout_logprobs=lps[:3] + [0.01] + lps[4:]))  # a probability > 1
    assert logprobs_complete(trajectory("p", rollout_logprobs=lps[:3] + [1e-7] + lps[4:]))  # rounding, within 1e-6
    assert not logprobs_complete(trajectory("p", rollout_logprobs=lps[:-1]))  # one entry short
    assert not versions_complete(trajectory("p", versions=[None, None, None, 0, None, None, None, 1, 1]))
    assert not versions_complete(trajectory("p", versions=[0, None, None, 0, 0, None, None, 1, 1]))
    # Versions 1, 1, 0, 0 decrease; 0, 0, 2, 2 skip a version, which is fine (two updates mid-episode).
    assert not versions_monotone(trajectory("p", versions=[None, None, None, 1, 1, None, None, 0, 0]))
    assert versions_monotone(trajectory("p", versions=[None, None, None, 0, 0, None, None, 2, 2]))
    assert not action_mask_valid(trajectory("p", action_mask=[1, 0, 0, 1, 1, 0, 0, 1, 1]))  # action in prompt
    assert not action_mask_valid(trajectory("p", action_mask=[0, 0, 0, 2, 1, 0, 0, 1, 1]))
    assert not action_mask_valid(trajectory("p", action_mask=[0, 0, 0, 1, 1, 0, 0, 1]))
    frame = rollout_frame([good])
    assert tuple(frame.columns) == ROLLOUT_FRAME_COLUMNS and frame.at[0, "n_tokens"] == 9


def test_frames_know_the_parquet_schemas(tmp_path, good_traces):
    """The gates' scalar columns are the written files' columns, less the list and nested ones."""
    traces = pq.read_schema(write_traces(tmp_path / "t.parquet", good_traces[:2])).names
    assert set(traces) - set(TRACE_COLUMNS) == {"roles", "contents", "tool_codes", "reasonings"}
    assert set(TRACE_COLUMNS) <= set(traces)
    rollouts = pq.read_schema(write_trajectories(tmp_path / "r.parquet", [trajectory("p")])).names
    assert set(rollouts) - set(ROLLOUT_COLUMNS) == {
        "token_ids",
        "action_mask",
        "rollout_logprobs",
        "versions",
        "timings",
        "metadata",
        "routes",
    }
    assert set(ROLLOUT_COLUMNS) <= set(rollouts)


# ---- the trace gate ---------------------------------------------------------------------------------------


def test_good_traces_pass(chat, good_traces):
    report = check_traces(good_traces, chat, max_tokens=512, grade=grade_answer)
    assert report.success, report.failure_message()
    assert report.row_count == 31 and len(report.results) == 10 and report.failures == ()
    assert report.summary() == "data gate traces: passed 10 expectations on 31 rows"
    assert report.raise_if_failed() is report and report.failure_message() == ""
    assert "### Data gate `traces`: passed" in report.markdown() and "❌" not in report.markdown()


def test_bad_traces_fail_naming_expectation_and_rows(chat, good_traces):
    long_trace = Trace("long", (Turn("user", "Compute 1+1."), Turn("assistant", "a" * 200 + "\\boxed{2}")), 2)
    traces = good_traces[:6] + [
        Trace("empty", (USER, Turn("assistant", "  ")), 7),  # row 6: no final answer (so nothing boxed)
        Trace("wrong", (USER, Turn("assistant", "\\boxed{8}")), 7),  # row 7: boxed, but 3+4 is 7
        _call("", "print('<|/python|>')"),  # row 8: the code holds the closing marker
        _call("use <|python|>", "print(3+4)"),  # row 9: the text holds an opener
        long_trace,  # row 10: 14 prompt tokens + 200 + 9 + <|end|> = 224 > 120
        good_traces[0],  # row 11: the id of row 0 again
    ]
    traces[8] = dataclasses.replace(traces[8], problem_id="closer")
    traces[9] = dataclasses.replace(traces[9], problem_id="opener")
    first = good_traces[0].problem_id
    report = check_traces(traces, chat, max_tokens=120, grade=grade_answer)
    assert not report.success and report.row_count == 12
    assert failures(report) == {
        "expect_column_values_to_be_unique(problem_id)": [(0, first), (11, first)],
        "expect_column_values_to_not_be_null(final_answer)": [(6, "empty")],
        "expect_column_values_to_be_in_set(answer_correct)": [(6, "empty"), (7, "wrong")],
        "expect_column_values_to_be_in_set(calls_balanced)": [(8, "closer"), (9, "opener")],
        "expect_column_values_to_be_between(n_tokens)": [(10, "long")],
    }
    between = report.failures[-1]
    assert between.kwargs == {"min_value": 1, "max_value": 120} and between.rows[0].value == 224
    assert between.unexpected_count == 1 and between.unexpected_percent == pytest.approx(100 / 12)

    markdown = report.markdown()
    assert "| ❌ | expect_column_values_to_be_in_set | calls_balanced | 2 | closer, opener |" in markdown
    assert f"| ❌ | expect_column_values_to_be_unique | problem_id | 2 | {first}, {first} |" in markdown
    assert "| ✅ | expect_table_row_count_to_be_between |  | 0 |  |" in markdown
    assert (
        "**expect_column_values_to_be_between(n_tokens)**: 1 row (8.33%)\n\n| row | id | value |\n"
        "|---|---|---|\n| 10 | long | 224 |" in markdown
    )
    with pytest.raises(GateFailed) as failed:
        report.raise_if_failed()
    message = str(failed.value)
    assert isinstance(failed.value, ValueError) and failed.value.report is report
    assert message.startswith("data gate traces failed 5 of 10 expectations on 12 rows:")
    assert (
        "- expect_column_values_to_be_in_set(calls_balanced): 2 rows (16.7%); first: row 8 id='closer' "
        "value=False, row 9 id='opener' value=False"
    ) in message
    assert "- expect_column_values_to_not_be_null(final_answer): 1 row (8.33%); first: row 6 id='empty'" in message
    assert report.summary().startswith(
        "data gate traces: FAILED 5 of 10 expectations on 12 rows: "
        "expect_column_values_to_be_unique(problem_id): 2 rows (16.7%); "
    )


def test_empty_traces_fail_on_the_row_count(chat):
    report = check_traces([], chat, max_tokens=512, grade=grade_answer)
    assert [r.name for r in report.failures] == ["expect_table_row_count_to_be_between"]
    assert report.failures[0].observed_value == 0 and report.row_count == 0
    with pytest.raises(GateFailed, match=r"expect_table_row_count_to_be_between: observed 0"):
        report.raise_if_failed()


# ---- the rollout gate -------------------------------------------------------------------------------------


def test_good_rollouts_pass_also_through_parquet(tmp_path):
    trajectories = [trajectory(f"p{i}", reward=float(i % 2)) for i in range(4)]
    path = write_trajectories(tmp_path / "rollouts.parquet", trajectories)
    report = check_rollouts(read_trajectories(path), max_tokens=512)
    assert report.success, report.failure_message()
    assert report.row_count == 4 and len(report.results) == 14
    # The reward range is an argument: -1 fails the default [0, 1] and passes [-1, 1].
    negative = [trajectory("n", reward=-1.0)]
    assert [r.name for r in check_rollouts(negative, 512).failures] == ["expect_column_values_to_be_between(reward)"]
    assert check_rollouts(negative, 512, reward_range=(-1.0, 1.0)).success


def test_bad_rollouts_fail_naming_expectation_and_rows():
    lps, versions = trajectory("p").rollout_logprobs, trajectory("p").versions
    trajectories = [
        trajectory("ok"),
        trajectory("high", reward=1.5),
        trajectory("nan", reward=math.nan),
        trajectory("no-lp", rollout_logprobs=lps[:4] + [None] + lps[5:]),  # action token 4 has no log-prob
        trajectory("back", versions=[None, None, None, 1, 1, None, None, 1, 0]),
        trajectory("crash", finish_reason="crashed"),
        trajectory("positive", rollout_logprobs=lps[:3] + [0.5] + lps[4:]),
        trajectory("no-version", versions=versions[:7] + [None] + versions[8:]),
        trajectory("in-prompt", action_mask=[1] + [0] * 2 + [1, 1, 0, 0, 1, 1]),
        trajectory(
            "long",
            token_ids=list(range(13)),
            action_mask=[0] * 3 + [1, 1] + [0] * 6 + [1, 1],
            rollout_logprobs=[None] * 3 + [-0.1, -0.2] + [None] * 6 + [-0.3, -0.4],
            versions=[None] * 3 + [0, 0] + [None] * 6 + [1, 1],
        ),  # 13 tokens > 12
    ]
    report = check_rollouts(trajectories, max_tokens=12)
    assert failures(report) == {
        "expect_column_values_to_not_be_null(reward)": [(2, "nan")],
        "expect_column_values_to_be_between(reward)": [(1, "high")],  # NaN is null, so only 1.5
        "expect_column_values_to_be_in_set(finish_reason)": [(5, "crash")],
        "expect_column_values_to_be_in_set(action_mask_valid)": [(8, "in-prompt")],
        "expect_column_values_to_be_in_set(logprobs_complete)": [(3, "no-lp"), (6, "positive"), (8, "in-prompt")],
        "expect_column_values_to_be_in_set(versions_complete)": [(7, "no-version"), (8, "in-prompt")],
        "expect_column_values_to_be_in_set(versions_monotone)": [(4, "back")],
        "expect_column_values_to_be_between(n_tokens)": [(9, "long")],
    }
    by_name = {r.name: r for r in report.failures}
    assert by_name["expect_column_values_to_be_in_set(finish_reason)"].rows[0].value == "crashed"
    assert by_name["expect_column_values_to_not_be_null(reward)"].rows[0].value == "nan"  # JSON-ready
    assert by_name["expect_column_values_to_be_between(reward)"].kwargs == {"min_value": 0.0, "max_value": 1.0}

    stored = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert stored["gate"] == "rollouts" and stored["success"] is False and stored["row_count"] == 10
    assert [row["id"] for r in stored["results"] if r["column"] == "versions_monotone" for row in r["rows"]] == ["back"]
    assert (
        "| ❌ | expect_column_values_to_be_in_set | logprobs_complete | 3 | no-lp, positive, in-prompt |"
        in report.markdown()
    )
    with pytest.raises(GateFailed, match=r"versions_monotone\): 1 row \(10%\); first: row 4 id='back' value=False"):
        report.raise_if_failed()


def test_a_frame_missing_a_column_fails_the_schema_and_names_the_error():
    frame = rollout_frame([trajectory("a")]).drop(columns=["versions_monotone"])
    report = validate_frame(frame, "rollouts", rollout_expectations(512), "prompt_id")
    schema, monotone = report.failures
    assert schema.name == "expect_table_columns_to_match_set"
    assert schema.details == {"mismatched": {"missing": ["versions_monotone"]}}
    assert monotone.name == "expect_column_values_to_be_in_set(versions_monotone)"
    assert 'The column "versions_monotone" in BatchData does not exist' in monotone.error
    assert "- expect_column_values_to_be_in_set(versions_monotone): error: " in report.failure_message()
    with pytest.raises(ValueError, match="id_column"):
        validate_frame(frame, "rollouts", [], "problem_id")


def test_first_offending_rows_are_capped():
    trajectories = [trajectory(f"p{i}", finish_reason="crashed") for i in range(8)]
    (result,) = check_rollouts(trajectories, 512, max_rows=3).failures
    assert result.unexpected_count == 8 and [row.id for row in result.rows] == ["p0", "p1", "p2"]


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="reward_range"):
        rollout_expectations(512, reward_range=(1.0, 0.0))
    with pytest.raises(ValueError, match="min_tokens"):
        rollout_expectations(4, min_tokens=5)


def test_great_expectations_is_imported_only_inside_functions():
    """Its import takes ~4 s and `components.data` is imported everywhere: no module-level import."""
    for module in (gates, gate_frames):
        tree = ast.parse(Path(module.__file__).read_text())
        top = [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
        top += [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
        assert not [name for name in top if name.split(".")[0] == "great_expectations"], module.__name__
    (validate,) = [
        node
        for node in ast.parse(Path(gates.__file__).read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "validate_frame"
    ]
    assert any(
        isinstance(node, ast.Import) and node.names[0].name == "great_expectations" for node in ast.walk(validate)
    )  # the one lazy import


def test_markdown_cells_escape_pipes_and_newlines():
    report = check_rollouts([trajectory("a|b", finish_reason="crashed\nbadly")], 512)
    # A raw `|` would split the table cell and a newline would end the row.
    assert "| 0 | a\\|b | crashed\\nbadly |" in report.markdown()
    assert "| ❌ | expect_column_values_to_be_in_set | finish_reason | 1 | a\\|b |" in report.markdown()
