"""The hand-written answer rules and math-verify side by side: `python -m bench.grading_compare [FILE ...]`.

Sources of cases (`bench.grading_cases`):

- the benchmark rows the repository holds (the made-up rows of `tests/eval/test_benchmarks.py`, one per public
  release's format) and every benchmark FILE named on the command line (`load_benchmark("auto", FILE)`), each
  reference with answers written from it;
- every case of the grader's tests (the tables of `tests/eval/test_math_grading.py` and `tests/data/test_data.py`),
  both ways round where the test asserts symmetry, each with the test's expectation.

Three graders answer each case: `rules` (the project's grader before math-verify: an int reference exactly,
otherwise `answer_rules.rules_equal`), `math-verify` (`math_verifier.Verifier`, no verdict when late) and `grading`
(the production rule, `grading.grade_answer`). It prints, per source, the cases, the disagreements of rules and
math-verify and who was right in them, the disagreements by kind of answer, every disagreement, and per-answer
times. `--all` also prints the cases where the production rule is wrong; `--rules-file` compares an older grading
module's `math_equal` instead of today's rules (docs/grading.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from bench.grading_cases import Case, benchmark_cases
from components.contracts.task import Task
from components.envs.answer_rules import rules_equal
from components.envs.grading import (
    _INTEGER,
    extract_boxed,
    grade_answer,
    math_equal,
    reference_answer,
    task_reference,
)
from components.envs.math_verifier import Verifier
from components.eval.benchmarks import load_benchmark

_ROOT = Path(__file__).resolve().parents[1]


def repository_benchmarks() -> dict[str, list]:
    """The tests' made-up benchmark rows, one list of references per release format."""
    from tests.eval import test_benchmarks as tb

    return {
        "tests: aime2025 rows": [r["answer"] for r in tb.AIME_ROWS],
        "tests: hmmt rows": [r["answer"] for r in tb.HMMT_ROWS],
        "tests: beyondaime rows": [r["answer"] for r in tb.BEYOND_ROWS],
        "tests: imoanswerbench rows": [r[2] for r in tb.IMO_ROWS],
    }


def _table(test) -> list[tuple]:
    """The rows of a test's `@pytest.mark.parametrize` table."""
    return next(list(mark.args[1]) for mark in test.pytestmark if mark.name == "parametrize")


def test_cases() -> list[Case]:
    """Every (answer, reference, expected) of the grader's tests, the expectation being the test's."""
    from tests.data import test_data
    from tests.eval import test_math_grading as tg

    cases = []
    for pred, ref, right in _table(tg.test_math_equal_pairs):  # the test asserts both directions
        cases += [
            Case("tests: PAIRS", "test", ref, pred, right),
            Case("tests: PAIRS reversed", "test", pred, ref, right),
        ]
    for pred, ref, right in _table(tg.test_math_equal_numeric_references):
        cases.append(Case("tests: numeric references", "test", ref, pred, right))
    for test, name in ((tg.test_grade_answer, "tests: grade_answer"), (test_data.test_grading, "tests: data grading")):
        cases += [Case(name, "text", ref, text, right) for text, ref, right in _table(test)]
    return cases


def _old_reference(case: Case) -> int | str | float:
    """The reference the grader got before math-verify: a test's as the test passes it, a benchmark's through
    `reference_answer` (an integer, AIME's say, then graded exactly)."""
    return case.ref if case.kind in ("test", "text") else reference_answer(case.ref)


def _integer(case: Case) -> bool:
    """Graded as an exact integer before math-verify (`reference_answer` made the reference an int)."""
    ref = _old_reference(case)
    return case.kind != "test" and isinstance(ref, int) and not isinstance(ref, bool)


def _rules(case: Case, boxed: str, equal: Callable[[str, object], bool]) -> bool:
    """The project's grader before math-verify: the old `grade_answer` on a boxed answer, `equal` comparing
    non-integer answers (on a test of `math_equal`, `equal` alone)."""
    if _integer(case):
        return bool(_INTEGER.fullmatch(boxed.strip())) and int(boxed.strip()) == _old_reference(case)
    return equal(boxed, _old_reference(case))


def load_rules(path: str | None) -> Callable[[str, object], bool]:
    """`answer_rules.rules_equal`, or the `math_equal` of an older grading module's file (`git show
    4cc6e39:components/envs/grading.py > old.py`: the grader before math-verify, which imports only the standard
    library)."""
    if path is None:
        return rules_equal
    spec = importlib.util.spec_from_file_location("old_grading", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.math_equal


def _production(case: Case) -> bool:
    """The grader now: `math_equal` for a test of it, `grade_answer` for a test of that, and for a benchmark's
    reference what `tir_math` does (`task_reference`: a benchmark's answer graded by value)."""
    if case.kind == "test":
        return math_equal(case.pred, case.ref)
    if case.kind == "text":
        return grade_answer(case.pred, case.ref)
    task = Task("bench", "", case.ref, {"benchmark": case.source})
    return grade_answer(f"so \\boxed{{{case.pred}}}", task_reference(task))


def grade_all(cases: list[Case], verifier: Verifier, equal: Callable[[str, object], bool] = rules_equal) -> list[dict]:
    """Each case graded by the rules, math-verify and the production rule, with the time each took."""
    rows = []
    for case in cases:
        boxed = extract_boxed(case.pred) if case.kind == "text" else case.pred  # a text is a whole model turn
        start = time.perf_counter()
        rules = _rules(case, boxed, equal) if boxed is not None else False
        t_rules = time.perf_counter() - start
        start = time.perf_counter()
        mv = verifier.verify_equal(boxed, str(case.ref)) if boxed is not None else False
        t_mv = time.perf_counter() - start
        start = time.perf_counter()
        production = _production(case)
        t_production = time.perf_counter() - start
        rows.append(dict(case=case, rules=rules, mv=mv, grading=production, t=(t_rules, t_mv, t_production)))
    return rows


def _summary(rows: list[dict]) -> None:
    by_source: dict[str, Counter] = {}
    for row in rows:
        c = row["case"]
        count = by_source.setdefault(c.source + (" [integer]" if _integer(c) else ""), Counter())
        count["cases"] += 1
        count["rules wrong"] += row["rules"] != c.right
        count["mv wrong"] += row["mv"] is not c.right
        count["mv late"] += row["mv"] is None
        count["grading wrong"] += row["grading"] != c.right
        if row["rules"] != row["mv"]:
            count["disagree"] += 1
            count["rules right"] += row["rules"] == c.right
            count["mv right"] += row["mv"] is c.right
    keys = ["cases", "disagree", "rules right", "mv right", "rules wrong", "mv wrong", "mv late", "grading wrong"]
    print("| source | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    total = Counter()
    for source, count in by_source.items():
        total.update(count)
        print(f"| {source} | " + " | ".join(str(count[k]) for k in keys) + " |")
    print("| **all** | " + " | ".join(str(total[k]) for k in keys) + " |")


def _by_kind(rows: list[dict]) -> None:
    """Disagreements of rules and math-verify grouped by the kind of answer: how many, who was right, one example."""
    groups: dict[tuple[str, bool], list[dict]] = {}
    for row in rows:
        if row["rules"] != row["mv"]:
            groups.setdefault((row["case"].kind, _integer(row["case"])), []).append(row)
    print(
        "\n| kind | integer reference | disagreements | rules right | math-verify right | example (answer vs reference) |"
    )
    print("|---|---|---|---|---|---|")
    for (kind, integer), group in sorted(groups.items(), key=lambda item: -len(item[1])):
        c = group[0]["case"]
        example = f"`{c.pred}` vs `{str(c.ref).strip()}`".replace("|", "\\|").replace("\n", " ")
        rules_right = sum(r["rules"] == r["case"].right for r in group)
        mv_right = sum(r["mv"] is r["case"].right for r in group)
        print(f"| {kind} | {'yes' if integer else 'no'} | {len(group)} | {rules_right} | {mv_right} | {example} |")


def _disagreements(rows: list[dict], show_all: bool) -> None:
    print("\n| source | kind | reference | answer | right | rules | math-verify | grading |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        c = row["case"]
        if row["rules"] != row["mv"] or (show_all and row["grading"] != c.right):
            ref, pred = str(c.ref).replace("|", "\\|").strip(), c.pred.replace("|", "\\|").replace("\n", " ")
            print(
                f"| {c.source} | {c.kind} | `{ref}` | `{pred}` | {c.right} | {row['rules']} | {row['mv']} | "
                f"{row['grading']}{'' if row['grading'] == c.right else ' (wrong)'} |"
            )


def _raw_approximations(cases: list[Case]) -> None:
    """math-verify alone (its decimals not made exact, as `math_verifier_worker` makes them) on the answers that
    only approximate the reference: how many it calls equal. Why the worker makes decimals exact."""
    from math_verify import LatexExtractionConfig, parse, verify

    def read(answer: str) -> list:
        return parse(f"\\boxed{{{answer}}}", [LatexExtractionConfig()], parsing_timeout=None)

    counts: dict[str, Counter] = {}
    for c in cases:
        if c.kind in ("rounded-6", "rounded-3", "approximated-6") or (c.kind == "percent-of" and not c.right):
            count = counts.setdefault(c.kind, Counter())
            count["cases"] += 1
            count["equal"] += verify(read(str(c.ref).strip().strip("$")), read(c.pred), timeout_seconds=None)
    print("\nmath-verify alone on approximations (all wrong answers): called equal / cases")
    for kind, count in counts.items():
        print(f"  {kind:15s} {count['equal']} / {count['cases']}")


def _timings(rows: list[dict]) -> None:
    print("\nper answer, ms (math-verify: a round trip to its warm worker, parse and compare included)")
    for i, name in enumerate(("rules", "math-verify", "grading")):
        ms = sorted(row["t"][i] * 1e3 for row in rows)
        p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
        print(
            f"  {name:12s} mean {statistics.mean(ms):7.3f}  median {statistics.median(ms):7.3f}  "
            f"p99 {p99:7.2f}  max {ms[-1]:7.1f}  total {sum(ms) / 1e3:6.2f} s over {len(ms)}"
        )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="benchmark files (JSONL, Parquet, CSV) to add")
    parser.add_argument("--all", action="store_true", help="also print cases the production rule gets wrong")
    parser.add_argument("--rules-file", help="compare the math_equal of this grading module (an older one)")
    args = parser.parse_args(argv)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the bench's own parses run without time limits
    if str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))  # for `tests.*`
    cases = []
    for source, references in repository_benchmarks().items():
        cases += benchmark_cases(source, references)
    for path in args.files:
        tasks = load_benchmark("auto", path)
        cases += benchmark_cases(f"{Path(path).name} ({tasks[0].metadata['benchmark']})", [t.answer for t in tasks])
    cases += test_cases()
    verifier = Verifier()
    start = time.perf_counter()
    verifier.verify_equal("1", "1")  # the worker's start is not an answer's time
    print(f"math-verify worker started in {time.perf_counter() - start:.2f} s")
    rows = grade_all(cases, verifier, load_rules(args.rules_file))
    _summary(rows)
    _by_kind(rows)
    _disagreements(rows, args.all)
    _timings(rows)
    _raw_approximations(cases)
    print(f"\nmath-verify workers killed after a late answer: {verifier.restarts}")
    verifier.close()


if __name__ == "__main__":
    main(sys.argv[1:])
