"""Synthetic task, teacher traces, trace format and its Parquet round trip, grading."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.chat import MarkerFormat, render_trace
from components.data.tasks import generate_problems, make_problem
from components.data.teacher import teacher_trace
from components.data.traces import (
    Trace,
    Turn,
    read_traces,
    trace_from_openai_messages,
    write_traces,
)
from components.envs.grading import extract_boxed, grade_answer
from components.models import build_tokenizer


def test_problems_are_deterministic_and_splits_disjoint():
    a = generate_problems(("affine", "two_step"), 50, seed=3, operand_max=20, split="train")
    b = generate_problems(("affine", "two_step"), 50, seed=3, operand_max=20, split="train")
    assert a == b
    held_out = {p.question for p in generate_problems(("affine", "two_step"), 200, 3, 20, "eval")}
    assert not held_out & {p.question for p in a}
    assert {p.kind for p in a} == {"affine", "two_step"}
    assert make_problem("two_step", (2, 3, 4, 5), "x").answer == (2 * 3 + 4) * 5
    with pytest.raises(ValueError, match="kind"):
        make_problem("cubic", (1, 2, 3), "x")


def test_teacher_trace_and_rendering():
    tokenizer = build_tokenizer()
    trace = teacher_trace(make_problem("two_step", (7, 35, 67, 64), "p0"))
    # Two tool calls; the second uses the first call's output, the answer is copied from the last output.
    assert [t.role for t in trace.turns] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert trace.turns[1].tool_code == "print(7*35+67)" and trace.turns[2].content == "312\n"
    assert trace.turns[3].tool_code == "print(312*64)" and trace.turns[5].content == "\\boxed{19968}"
    ids, mask = render_trace(MarkerFormat(tokenizer), trace)
    text = tokenizer.decode(ids)
    assert text == (
        "<|user|>Compute (7*35+67)*64.<|assistant|><|python|>print(7*35+67)<|/python|>"
        "<|output|>312\n<|/output|><|python|>print(312*64)<|/python|><|output|>19968\n<|/output|>"
        "\\boxed{19968}<|end|>"
    )
    # Action tokens are exactly the assistant's: decode the masked-in ids.
    actions = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert actions == "<|python|>print(7*35+67)<|/python|><|python|>print(312*64)<|/python|>\\boxed{19968}<|end|>"


def test_openai_messages_parse_to_the_same_trace():
    messages = [
        {"role": "system", "content": "You can run Python."},
        {"role": "user", "content": "Compute 7*35+67."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "python", "arguments": json.dumps({"code": "print(7*35+67)"})},
                }
            ],
        },
        {"role": "tool", "content": "312\n"},
        {"role": "assistant", "content": "\\boxed{312}"},
    ]
    parsed = trace_from_openai_messages("p0", messages, 312)
    assert parsed == teacher_trace(make_problem("affine", (7, 35, 67), "p0"))
    bad = messages[:2] + [{"role": "assistant", "tool_calls": [{"function": {"name": "bash", "arguments": "{}"}}]}]
    with pytest.raises(ValueError, match=r"messages\[2\].tool_calls\[0\].function.name"):
        trace_from_openai_messages("p0", bad, 312)


def test_trace_validation_names_the_turn():
    with pytest.raises(ValueError, match=r"turns\[2\].role must be 'tool'"):
        Trace("p", (Turn("user", "q"), Turn("assistant", "", "print(1)"), Turn("assistant", "x")), 1)
    with pytest.raises(ValueError, match="last turn"):
        Trace("p", (Turn("user", "q"), Turn("assistant", "", "print(1)"), Turn("tool", "1\n")), 1)


def test_parquet_round_trip_and_malformed_rows(tmp_path):
    traces = [teacher_trace(p) for p in generate_problems(("affine", "two_step"), 6, 0, 99, "train")]
    path = write_traces(tmp_path / "t.parquet", traces)
    assert read_traces(path) == traces
    table = pq.read_table(path).to_pylist()
    table[4]["roles"][1] = "tool"
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(path)), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"row 4: .*turns\[1\].role"):
        read_traces(tmp_path / "bad.parquet")


@pytest.mark.parametrize(
    "text, answer, ok",
    [
        ("\\boxed{449}", 449, True),
        ("so \\boxed{ 449 }<|end|>", 449, True),
        ("\\boxed{12} then \\boxed{449}", 449, True),  # the last box counts
        ("\\boxed{449.0}", 449, False),  # exact integer answers only
        ("\\boxed{448}", 449, False),
        ("449", 449, False),
        ("\\boxed{-3}", -3, True),
    ],
)
def test_grading(text, answer, ok):
    assert grade_answer(text, answer) is ok


def test_extract_boxed_matches_braces():
    assert extract_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{unclosed") is None


def test_teacher_answers_small_products_without_the_tool():
    # 7*35 = 245 < 700: a strong teacher does it in its head; 51*99 = 5049 >= 700 goes to the tool.
    mental = teacher_trace(make_problem("affine", (7, 35, 67), "p0"), mental_max=700)
    assert [t.role for t in mental.turns] == ["user", "assistant"] and mental.turns[1].content == "\\boxed{312}"
    tool = teacher_trace(make_problem("affine", (51, 99, 55), "p1"), mental_max=700)
    assert tool.turns[1].tool_code == "print(51*99+55)"


def test_teacher_mental_frac_answers_a_fixed_share_of_the_small_products_in_its_head():
    problems = generate_problems(("affine",), 2000, 0, 99, "train")
    small = [p for p in problems if p.operands[0] * p.operands[1] < 700]

    def mental(frac):
        return {p.question for p in problems if len(teacher_trace(p, 700, frac).turns) == 2}

    assert mental(1.0) == {p.question for p in small}  # the default: every small product, as before
    assert mental(0.0) == set()
    share = len(mental(0.7)) / len(small)
    assert 0.65 < share < 0.75, share  # a hash of the question: about 70% of the 460-odd small problems
    assert mental(0.4) < mental(0.7) < mental(1.0)  # a question answered in the head stays so at a larger share
    assert mental(0.7) == mental(0.7)  # fixed per question, not drawn per call


def test_teacher_observations_are_what_the_sandbox_prints():
    from components.sandbox.run import run_python

    for problem in generate_problems(("affine", "two_step"), 4, 0, 999, "train"):
        turns = teacher_trace(problem).turns
        for call, output in zip(turns[1::2], turns[2::2]):
            assert run_python(call.tool_code).stdout == output.content
