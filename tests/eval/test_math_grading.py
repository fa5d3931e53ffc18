"""Math-answer grading: `math_equal` (the answer rules, then math-verify) on hand-written pairs, the pairs where
the rules and math-verify disagree with the right verdict asserted, `extract_boxed`, `grade_answer`, the guarantee
that nothing is evaluated, and the tir_math environment grading benchmark answers in real episodes."""

from __future__ import annotations

import asyncio
import builtins

import pytest

from components.chat.markers import parse_turn
from components.contracts.markers import CALL, CALL_END, END
from components.contracts.task import Task
from components.envs.answer_rules import rules_equal
from components.envs.grading import extract_boxed, grade_answer, math_equal, reference_answer, task_reference
from components.envs.math_verifier import VERIFIER
from components.envs.tir_math import TIRMathEnvironment

PAIRS = [
    # --- integers with thousands separators (only groups of exactly three digits)
    ("1,000", "1000", True),  # comma separator: one thousand
    ("1 000", "1000", True),  # space separator
    ("1\\,000", "1000", True),  # LaTeX thin space as separator
    ("1{,}000", "1000", True),  # braced comma, the LaTeX way to stop the comma spacing
    ("12,345,678", "12345678", True),  # several groups
    ("-1,000", "-1000", True),  # a sign in front of a grouped integer
    ("1000", "100", False),  # different values: 1000 != 100
    ("1,00", "100", False),  # a group of two digits is no thousands group: the list (1, 00), not 100
    ("1 00", "100", False),  # a gap between digits that is no thousands group is kept: not 100
    # --- fractions and decimals, compared as exact rationals
    ("3/4", "0.75", True),  # 3/4 = 75/100
    ("0.75", "\\frac{3}{4}", True),  # decimal against \frac
    (".75", "3/4", True),  # no leading zero
    ("0.750", "3/4", True),  # trailing zero: 750/1000 = 3/4
    ("\\dfrac{3}{4}", "0.75", True),  # \dfrac is \frac in display size
    ("\\tfrac{3}{4}", "3/4", True),  # \tfrac is \frac in text size
    ("\\frac34", "\\frac{3}{4}", True),  # one-digit arguments without braces
    ("6/8", "\\frac{3}{4}", True),  # unreduced: 6/8 = 3/4
    ("\\frac{2}{1}", "2", True),  # 2/1 = 2
    ("0.33", "1/3", False),  # 33/100 != 1/3
    ("0.3333333333", "\\frac{1}{3}", False),  # a truncated decimal is still not 1/3: no float tolerance
    ("\\frac{1}{2}", "2", False),  # 1/2 != 2
    ("2+2", "4", True),  # math-verify: the expression's value is 4
    # --- negative signs in every position
    ("-\\frac{3}{4}", "-0.75", True),  # sign in front of \frac
    ("\\frac{-3}{4}", "-3/4", True),  # sign on the numerator
    ("\\frac{3}{-4}", "-.75", True),  # sign on the denominator
    ("3/-4", "-0.75", True),  # sign on a plain denominator
    ("\u22123", "-3", True),  # U+2212 MINUS SIGN is a minus
    ("-3/4", "3/4", False),  # the sign matters
    # --- text wrappers keep their content
    ("\\text{5}", "5", True),  # \text{5} is 5
    ("\\mathrm{5}", "5", True),  # \mathrm{5} is 5
    ("\\textbf{\\frac{1}{2}}", "0.5", True),  # bold 1/2 is 1/2
    ("\\text{yes}", "yes", True),  # a word answer, compared as a string
    # --- a leading variable and equals sign
    ("x = 5", "5", True),  # "x = 5" answers 5
    ("n=12", "12", True),  # no spaces
    ("x = \\frac{1}{2}", "0.5", True),  # the value after the = is parsed as a number
    ("x = 5", "6", False),  # 5 != 6
    ("x = 1, y = 2", "(1, 2)", True),  # math-verify: the pair (x, y) = (1, 2), written as two assignments
    # --- trailing units, in \text{} or as words
    ("5 cm", "5", True),  # a unit word after a space
    ("5\\text{ meters}", "5", True),  # a unit in \text{}
    ("5 \\text{cm}^2", "5", True),  # a squared unit in \text{}
    ("5 square units", "5", True),  # several unit words
    ("6 cm", "5 cm", False),  # 6 != 5 with the units gone
    ("3 x", "3", False),  # one bare letter may be a product (3x): not a unit
    ("2 pi", "2", False),  # pi is a value, not a unit: 2 pi != 2
    ("1", "1 and odd prime numbers", False),  # words of prose are no unit: the answer is more than the number 1
    ("1 million", "1", False),  # a scale word is not a unit: 1 million != 1
    # --- trailing periods, dollar signs, math delimiters, degrees
    ("5.", "5", True),  # a sentence's full stop
    ("\\$5", "5", True),  # an escaped dollar sign (money)
    ("\\$1,000", "1000", True),  # money with a thousands separator
    ("$\\frac{3}{4}$", "0.75", True),  # inline math delimiters
    ("\\(\\frac{3}{4}\\)", "3/4", True),  # \( ... \) delimiters
    ("30^\\circ", "30", True),  # degrees
    ("30^{\\circ}", "30", True),  # degrees, braced
    ("45^\\circ", "30^\\circ", False),  # 45 != 30
    # --- \left and \right are sizing noise
    ("\\left( 1, 2 \\right)", "(1,2)", True),  # the same pair
    ("\\left[ 0, 1 \\right)", "[0,1)", True),  # the same half-open interval
    # --- percent: a unit mark, never a factor of 1/100
    ("50\\%", "50", True),  # "what percent": 50% answers 50
    ("50\\%", "50%", True),  # both with the sign
    ("50\\%", "0.5", True),  # 50% is 50/100 = 1/2
    ("75\\%", "\\frac{3}{4}", True),  # 75/100 = 3/4
    ("33.3333\\%", "\\frac{1}{3}", False),  # 333333/1000000 != 1/3, math-verify's 6 places would say equal
    ("5\\%", "50\\%", False),  # 5 != 50
    # --- answers that are not numbers: normalised strings
    ("\\sqrt{2}", "\\sqrt2", True),  # braces around a one-digit argument
    ("\\sqrt{2}", "\\sqrt{3}", False),  # different radicands
    ("x^{2} + 1", "x^2+1", True),  # braced exponent and spaces
    ("x^2+1", "x^2-1", False),  # different polynomials
    ("2\\sqrt{2}", "\\sqrt{8}", True),  # math-verify: sqrt(8) = sqrt(4 * 2) = 2 sqrt(2)
    ("2\\sqrt{2}", "\\sqrt{6}", False),  # 8 != 6 under the root
    # --- tuples, intervals, sets and lists
    ("(1, 2)", "(1,2)", True),  # spacing only
    ("(0.5, 3/4)", "(\\frac{1}{2}, 0.75)", True),  # element-wise numbers: 1/2 = 0.5 and 3/4 = 0.75
    ("(1{,}000, 2)", "(1000, 2)", True),  # a grouped integer inside a tuple
    ("(1, 2)", "(2, 1)", False),  # a tuple is ordered
    ("(1, 2)", "(1, 2, 3)", False),  # different lengths
    ("[0, 1)", "[0, 1]", False),  # half-open is not closed
    ("\\{1, 2\\}", "\\{2,1\\}", True),  # a set has no order
    ("2026, 2030", "2030, 2026", True),  # "find all values": a bare list in any order
    ("1, 2", "(1, 2)", False),  # a bare list is not a tuple (math-verify says equal)
    ("\\{1, 2\\}", "2, 1", True),  # a set and a bare list are both unordered
    ("\\{1, 2\\}", "(1, 2)", False),  # the set {1, 2} is not the open interval (1, 2) (math-verify says equal)
]


@pytest.mark.parametrize("pred, ref, expected", PAIRS)
def test_math_equal_pairs(pred, ref, expected):
    assert math_equal(pred, ref) is expected
    assert math_equal(ref, pred) is expected  # every rule applies to both sides alike


# Where the answer rules and math-verify (as `math_verifier` asks it) disagree, measured by
# `python -m bench.grading_compare` (docs/grading.md): (answer, reference, rules, math-verify, right).
DISAGREEMENTS = [
    # math-verify right: equal values written as different expressions
    ("3\\frac{1}{2}", "3.5", False, True, True),  # the mixed number 3 1/2 = 7/2 = 3.5
    ("1+\\sqrt{2}", "\\sqrt{2}+1", False, True, True),  # a sum commuted
    ("\\sqrt{8}", "2\\sqrt{2}", False, True, True),  # sqrt(8) = 2 sqrt(2)
    ("2+2", "4", False, True, True),  # 2 + 2 = 4
    ("n \\ge 3, n=1", "n=1, n \\ge 3", False, True, True),  # the same two conditions, in the other order
    ("x = 1, y = 2", "(1, 2)", False, True, True),  # the pair (x, y) = (1, 2)
    # the rules right: a set or a bare list is no tuple or interval (math-verify reads (1, 2) as an interval and
    # calls it equal to the set {1, 2})
    ("\\{1, 2\\}", "(1, 2)", False, True, False),
    ("1, 2", "(1, 2)", False, True, False),
    # the rules right: thousands separators and spacing math-verify does not read
    ("(1{,}000, 2)", "(1000, 2)", True, False, True),  # 1{,}000 = 1000 inside a tuple
    ("1\\,000", "1000", True, False, True),  # a thin space between thousands
    ("p_1^{p_1^{e_1}-1}\\cdotsp_k^{p_k^{e_k}-1}", "p_1^{p_1^{e_1}-1} \\cdots p_k^{p_k^{e_k}-1}", True, False, True),
]


@pytest.mark.parametrize("pred, ref, rules, mv, right", DISAGREEMENTS)
def test_rules_and_math_verify_disagree_and_math_equal_picks_the_right_one(pred, ref, rules, mv, right):
    assert rules_equal(pred, ref) is rules
    assert VERIFIER.verify_equal(pred, ref) is mv
    assert math_equal(pred, ref) is right


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("0.333333", "\\frac{1}{3}"),  # 333333/1000000 = 1/3 - 1/3000000
        ("2.414214", "1+\\sqrt{2}"),  # 1 + sqrt(2) = 2.41421356...: a 6-place approximation
        ("-3.333333", "-\\frac{10}{3}"),  # -10/3 = -3.333...
    ],
)
def test_a_rounded_decimal_is_not_the_exact_answer(pred, ref):
    # math-verify alone rounds a comparison with a decimal to 6 places and calls these equal; the worker makes
    # every decimal the rational it writes first, so neither the rules nor math-verify accept an approximation.
    from math_verify import LatexExtractionConfig, parse, verify

    raw = [parse(f"\\boxed{{{x}}}", [LatexExtractionConfig()], parsing_timeout=None) for x in (ref, pred)]
    assert verify(*raw, timeout_seconds=None) is True  # what math-verify itself says
    assert VERIFIER.verify_equal(pred, ref) is False
    assert math_equal(pred, ref) is False


@pytest.mark.parametrize(
    "pred, ref, expected",
    [
        ("1,000", 1000, True),  # int reference: 1000
        ("999", 1000, False),  # 999 != 1000
        ("1000.0", 1000, True),  # math_equal compares values (grade_answer keeps ints exact)
        ("3/4", 0.75, True),  # 0.75 is exactly 3/4 in binary
        ("0.1", 0.1, True),  # repr(0.1) is "0.1": read as 1/10, not the binary float's 0.1000000000000000055...
        ("0.3", 0.1 + 0.2, False),  # the float sum is 0.30000000000000004, not 3/10
        ("1", float("nan"), False),  # no value equals NaN
    ],
)
def test_math_equal_numeric_references(pred, ref, expected):
    assert math_equal(pred, ref) is expected


def test_math_equal_refuses_what_is_no_answer():
    assert math_equal(None, "5") is False  # no boxed answer
    assert math_equal("", "") is False  # an empty answer equals nothing, not even itself
    assert math_equal("5" * 1001, "5" * 1001) is False  # over MAX_ANSWER_CHARS: not an answer
    with pytest.raises(TypeError, match="ref: expected a str, int or float answer, got list"):
        math_equal("1", [1])
    with pytest.raises(TypeError, match="got bool"):
        math_equal("1", True)


def test_math_equal_never_executes_code(tmp_path, monkeypatch):
    marker = tmp_path / "executed"
    payload = f"__import__('os').system('touch {marker}')"

    def refuse(*args, **kwargs):
        raise AssertionError("math_equal evaluated its input")

    texts = (
        payload,
        f"${payload}$",
        f"\\boxed{{{payload}}}",
        f"x = {payload}",
        f"({payload}, 1)",
        "eval('1+1')",
        "lambda: 0",
    )
    with monkeypatch.context() as patch:  # eval, exec and compile are gone while math_equal runs
        for name in ("eval", "exec", "compile"):
            patch.setattr(builtins, name, refuse)
        results = [(math_equal(t, "0"), math_equal("0", t), math_equal(t, t)) for t in texts]
        still_grades = math_equal("(\\frac{3}{4}, 1{,}000)", "(0.75, 1000)")
    # never equal to a value; equal only to the identical string, which is compared, not run
    assert results == [(False, False, True)] * len(texts)
    assert still_grades  # (3/4, 1000) graded with eval gone
    assert not marker.exists()


def test_extract_boxed():
    assert extract_boxed("so \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"  # nested braces kept
    assert extract_boxed("\\boxed{\\{1, \\{2\\}\\}}") == "\\{1, \\{2\\}\\}"  # escaped braces still pair up
    assert extract_boxed("first \\boxed{12}, then \\boxed{449}") == "449"  # the last box counts
    assert extract_boxed("the answer is 449") is None  # no box
    assert extract_boxed("\\boxed{\\frac{1}{2}") is None  # unbalanced: the box never closes
    assert extract_boxed("\\boxed{3} and \\boxed{4") is None  # the last box is unclosed: no answer
    assert extract_boxed("\\boxed{}") == ""  # an empty box is an empty answer


@pytest.mark.parametrize(
    "text, answer, ok",
    [
        ("\\boxed{449}", 449, True),  # int answer: exact
        ("\\boxed{449.0}", 449, False),  # int answers stay exact integers
        ("\\boxed{1,000}", 1000, False),  # ... with no separators either
        ("\\boxed{0.75}", "\\frac{3}{4}", True),  # str answer: math_equal
        ("\\boxed{3/4}", 0.75, True),  # float answer: math_equal
        ("\\boxed{1,000}", "1000", True),  # str answer: math_equal accepts the separator
        ("\\boxed{0.7}", "\\frac{3}{4}", False),  # 7/10 != 3/4
        ("0.75", "\\frac{3}{4}", False),  # no box
    ],
)
def test_grade_answer(text, answer, ok):
    assert grade_answer(text, answer) is ok


def test_reference_answer_keeps_integers_exact():
    assert reference_answer("449") == 449 and isinstance(reference_answer("449"), int)
    assert reference_answer(" -3 ") == -3
    assert reference_answer(449) == 449
    assert reference_answer("\\frac{3}{4}") == "\\frac{3}{4}"
    assert reference_answer("1,000") == "1,000"  # not a plain integer: math_equal decides
    assert reference_answer(0.75) == 0.75


def _episode(answer, final: str, metadata: dict | None = None) -> list:
    """One tir_math episode driven by hand: a real tool call in the sandbox, then the final answer."""
    task = Task("bench-1", "What is 3 divided by 4?", answer, metadata or {})
    episode = TIRMathEnvironment(tool_timeout_s=10.0).start(task)

    async def run():
        return [
            await episode.step(parse_turn(f"Divide.{CALL}print(3/4){CALL_END}", False), False),
            await episode.step(parse_turn(final, False), False),
        ]

    return asyncio.run(run())


def test_tir_math_grades_a_fraction_benchmark_answer():
    tool, answer = _episode("\\frac{3}{4}", f"So it is \\boxed{{0.75}}{END}")
    assert tool.observation == "0.75\n" and not tool.done
    assert (answer.done, answer.reward, answer.finish_reason) == (True, 1.0, "stop")
    assert answer.info == {"correct": True, "tool_calls": 1}
    # 0.7 = 7/10 is not 3/4: reward 0.
    assert _episode("\\frac{3}{4}", f"\\boxed{{0.7}}{END}")[1].reward == 0.0


@pytest.mark.parametrize("answer", [449, "449"])
def test_tir_math_grades_integer_answers_exactly_from_int_or_str(answer):
    # "449" as read from JSONL grades like the int 449: exact, so 449.0 earns nothing.
    assert _episode(answer, f"\\boxed{{449}}{END}")[1].reward == 1.0
    assert _episode(answer, f"\\boxed{{449.0}}{END}")[1].reward == 0.0


def test_task_reference_grades_benchmark_answers_by_value():
    assert task_reference(Task("aime2025-1", "q", 449, {"benchmark": "aime2025"})) == "449"  # text: by value
    assert task_reference(Task("hmmt-1", "q", " \\frac{3}{4} ", {"benchmark": "hmmt"})) == "\\frac{3}{4}"
    assert task_reference(Task("t-1", "q", "449")) == 449  # not a benchmark's: an exact integer
    assert task_reference(Task("t-2", "q", 0.75)) == 0.75


def test_tir_math_grades_a_benchmark_integer_by_value():
    aime = {"benchmark": "aime2025"}
    # 449.0 = 449 and 1{,}000 = 1000 for a benchmark's answer; the same boxes earn nothing on a synthetic task
    assert _episode(449, f"\\boxed{{449.0}}{END}", aime)[1].reward == 1.0
    assert _episode(1000, f"\\boxed{{1{{,}}000}}{END}", aime)[1].reward == 1.0
    assert _episode(449, f"\\boxed{{448}}{END}", aime)[1].reward == 0.0
    assert _episode(449, f"\\boxed{{449.0}}{END}")[1].reward == 0.0


def test_tir_math_grades_with_math_verify_off_the_main_thread():
    # sqrt(8) = 2 sqrt(2) needs math-verify; the episode grades in a worker thread of the event loop, where
    # math-verify's own signal-based limits would raise
    hmmt = {"benchmark": "hmmt"}
    right = _episode("2\\sqrt{2}", f"so \\boxed{{\\sqrt{{8}}}}{END}", hmmt)[1]
    assert (right.reward, right.info["correct"]) == (1.0, True)
    assert _episode("2\\sqrt{2}", f"so \\boxed{{\\sqrt{{6}}}}{END}", hmmt)[1].reward == 0.0  # sqrt(6) != sqrt(8)
