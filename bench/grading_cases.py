"""Cases for `bench.grading_compare`: a benchmark reference answer and answers written from it, each with the
verdict a correct grader gives, plus every case of the grader's tests.

A written answer is either the reference in another notation (same value: `0.75` for `\\frac{3}{4}`, `1{,}000`
for `1000`, `\\{2, 1\\}` for the set `1, 2`) or a wrong one (another value: the sign flipped, a digit changed, a
decimal rounded to 6 places for a value that has no finite decimal, a tuple reordered). The verdict is the
construction's: a notation keeps the value, a perturbation changes it. Where that could be argued (percent, an
interval's brackets), the choice is stated beside the transform and in docs/grading.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

from components.envs.answer_rules import exact_number


@dataclass(frozen=True)
class Case:
    source: str
    """Where the reference comes from: a benchmark file (or the tests' made-up benchmark rows), or a test."""
    kind: str
    """What was done to the reference: `same`, `decimal`, `negated`, ... or `test` for a test's own pair."""
    ref: int | str | float
    """The reference answer as `grade_answer` receives it (`reference_answer` applied)."""
    pred: str
    """The content of the model's `\\boxed{}`."""
    right: bool
    """The verdict a correct grader gives: the construction's, or the test's hand-computed expectation."""


def _decimal(v: Fraction) -> str | None:
    """`v` as a finite decimal (`3/4` -> `0.75`, `449` -> `449.0`), or None when it has none (`1/3`)."""
    d = v.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d != 1:
        return None
    text = format(Decimal(v.numerator) / Decimal(v.denominator), "f")
    return text if "." in text else text + ".0"


def _rounded(v: Fraction, places: int) -> str:
    return format(round(Decimal(v.numerator) / Decimal(v.denominator), places), "f")


def _latex_frac(v: Fraction, command: str = "\\frac") -> str:
    sign = "-" if v < 0 else ""
    return f"{sign}{command}{{{abs(v.numerator)}}}{{{v.denominator}}}"


def _plain(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


def number_variants(v: Fraction) -> list[tuple[str, str, bool]]:
    """(kind, answer, right) for a reference whose value is the exact number `v`."""
    out = [("plain", _plain(v), True), ("latex-frac", _latex_frac(v), True), ("dfrac", _latex_frac(v, "\\dfrac"), True)]
    decimal = _decimal(v)
    if decimal is not None:
        out.append(("decimal", decimal, True))
    else:  # a 6-place decimal is an approximation, not the value (HMMT and IMO-AnswerBench ask for exact answers)
        out += [("rounded-6", _rounded(v, 6), False), ("rounded-3", _rounded(v, 3), False)]
    if v.denominator != 1 and v < 0:
        out.append(("minus-numerator", f"\\frac{{-{abs(v.numerator)}}}{{{v.denominator}}}", True))
    if v.denominator != 1 and abs(v) > 1:  # the mixed number 3\frac{1}{2} = 7/2, as competitions write it
        whole, rest = divmod(abs(v.numerator), v.denominator)
        out.append(("mixed-number", f"{'-' if v < 0 else ''}{whole}\\frac{{{rest}}}{{{v.denominator}}}", True))
    if v.denominator == 1 and abs(v) >= 1000:
        grouped = f"{abs(v.numerator):,}"
        sign = "-" if v < 0 else ""
        out += [
            ("thousands-comma", sign + grouped, True),
            ("thousands-brace", sign + grouped.replace(",", "{,}"), True),
            ("thousands-thin", sign + grouped.replace(",", "\\,"), True),
        ]
        digits = str(abs(v.numerator))
        out.append(
            ("scientific", f"{sign}{digits[0]}.{digits[1:].rstrip('0') or '0'}\\times 10^{{{len(digits) - 1}}}", True)
        )
    if v != 0:
        out.append(("negated", _plain(-v), False))
    out += [
        ("plus-one", _plain(v + 1), False),
        ("variable", f"x = {_plain(v)}", True),
        ("unit-text", f"{_plain(v)} \\text{{ cm}}", True),
        ("unit-word", f"{_plain(v)} units", True),
        ("degrees", f"{_plain(v)}^\\circ", True),
        ("period", f"{_plain(v)}.", True),
        ("dollars", f"${_plain(v)}$", True),
    ]
    # Percent is read two ways, and each variant below is right in its reading: `50\%` answers "what percent"
    # when the reference is the integer 50, and 75% is the number 3/4 when the reference is a fraction of 1.
    if v.denominator == 1:
        out.append(("percent-mark", f"{_plain(v)}\\%", True))
    elif 0 < v < 1:
        exact = _decimal(v * 100)  # 3/4 is 75%, 5/8 is 62.5%; 1/3 is not 33.3333%
        out.append(("percent-of", f"{(exact or _rounded(v * 100, 4)).removesuffix('.0')}\\%", exact is not None))
    return out


def _top_level(s: str, separator: str) -> list[str]:
    """`s` split at `separator` outside any brackets or braces (`\\{` `\\}` count as brackets)."""
    items, depth, begin = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == separator and depth == 0:
            items.append(s[begin:i])
            begin = i + 1
    return items + [s[begin:]]


def _last_digit_changed(s: str) -> str | None:
    digits = list(re.finditer(r"\d", s))
    if not digits:
        return None
    match = digits[-1]
    digit = "1" if match.group() != "1" else "2"
    return s[: match.start()] + digit + s[match.end() :]


_PROSE = re.compile(r"(?<![\\A-Za-z])(?:[A-Za-z]{3,}|(?:is|or|of|if|no|in|on|to|an|as|at|be)(?![A-Za-z]))")
"""A word of an answer in prose (`1 and odd prime numbers`, `even $n$`); a LaTeX command's name is none."""


def is_prose(ref: str) -> bool:
    return bool(_PROSE.search(ref))


def expression_variants(ref: str, value: object | None) -> list[tuple[str, str, bool]]:
    """(kind, answer, right) for a reference that is not one exact number: a list, an expression, words.
    `value` is the reference's numeric value as a sympy number when it has one (an irrational, say), else None."""
    inner = ref.strip().rstrip(".").rstrip()  # a reference's own full stop (`$2^{16}+1$.`)
    if inner.startswith("$") and inner.endswith("$") and inner.count("$") == 2:
        inner = inner[1:-1].strip()
    out = [("unwrapped", inner, True), ("dollars", f"${inner}$", True)]
    changed = _last_digit_changed(inner)
    if changed is not None:
        out.append(("digit-changed", changed, False))
    if is_prose(inner):  # words: only the same words, or a number picked out of them, can be checked
        leading = re.match(r"\s*(\d+)\s+[A-Za-z]", inner)
        if leading:  # "1 and odd prime numbers" is not answered by 1
            out.append(("number-of-prose", leading.group(1), False))
        return out
    out.append(("spacing", re.sub(r"\s+", "", inner), True))
    if "\\frac" in inner:
        out.append(("dfrac", inner.replace("\\frac", "\\dfrac"), True))
    items = _top_level(inner, ",")
    bracketed = inner[:1] in "([" and inner[-1:] in ")]"
    is_set = inner.startswith("\\{") and inner.endswith("\\}")
    ellipsis = "dots" in inner
    if len(items) > 1 and not bracketed and not is_set and not ellipsis:  # a bare list: "find all ..."
        out += [
            ("list-reordered", ", ".join(reversed([x.strip() for x in items])), True),
            ("list-as-set", "\\{" + ", ".join(x.strip() for x in items) + "\\}", True),
            ("list-dropped", ", ".join(x.strip() for x in items[:-1]), False),
        ]
    if bracketed and len(_top_level(inner[1:-1], ",")) > 1:
        elements = [x.strip() for x in _top_level(inner[1:-1], ",")]
        if len(set(elements)) > 1 and not ellipsis:  # a tuple or an interval: order matters
            out.append(("tuple-reordered", inner[0] + ", ".join(reversed(elements)) + inner[-1], False))
        out.append(("left-right", f"\\left{inner[0]} {', '.join(elements)} \\right{inner[-1]}", True))
        if len(elements) == 2 and "\\infty" not in inner:  # (a, b) vs [a, b]: an interval's ends are in or out
            swapped = {"(": "[", "[": "("}[inner[0]] + inner[1:-1] + {")": "]", "]": ")"}[inner[-1]]
            out.append(("brackets-swapped", swapped, False))
    terms = _top_level(inner, "+")
    if len(terms) == 2 and all(t.strip() for t in terms) and "=" not in inner and "," not in inner:
        a, b = terms[0].strip(), terms[1].strip()
        if not b.startswith("-"):
            out.append(("sum-commuted", f"{b}+{a}", True))
    if value is not None:  # a number written as an expression: its negative, and its value to 6 places
        if value != 0 and "," not in inner and "=" not in inner:
            out.append(("negated", f"-\\left({inner}\\right)", False))
        if not value.is_rational:  # an irrational has no finite decimal: 6 places approximate it
            out.append(("approximated-6", format(value.evalf(30), ".6f"), False))
    return out


def numeric_value(ref: str) -> object | None:
    """The reference's value as a sympy number when it has one (read by math-verify: the reference is trusted,
    this is the bench, not the grader), else None."""
    from math_verify import LatexExtractionConfig, parse

    inner = ref.strip().strip("$")
    parsed = parse(f"\\boxed{{{inner}}}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    expr = parsed[0] if parsed else None
    if getattr(expr, "is_number", False) and getattr(expr, "is_real", False):
        return expr
    return None


def benchmark_cases(source: str, references: list[int | str | float]) -> list[Case]:
    """Every reference of one benchmark, each with its variants (`number_variants` or `expression_variants`)."""
    cases = []
    for ref in references:
        text = str(ref)
        value = None if is_prose(text) else exact_number(text)
        if value is not None:
            variants = number_variants(value)
        else:
            variants = expression_variants(text, None if is_prose(text) else numeric_value(text))
        cases += [Case(source, kind, ref, pred, right) for kind, pred, right in variants]
    return cases
