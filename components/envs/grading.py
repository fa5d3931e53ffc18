"""Grading of `\\boxed{}` answers: exact integers for the synthetic task, equal values for benchmarks.

`grade_answer(text, answer)` reads the last `\\boxed{...}` of a model turn. With an integer answer the box must
hold exactly that integer (` 449 ` and `-3` pass, `449.0` and `4,49` do not): the synthetic arithmetic task and
its reward numbers depend on this staying strict. With a string or float answer (a benchmark's `\\frac{3}{4}`,
`(1, 2)`, `\\sqrt{2}`) the box is compared with `math_equal`. `reference_answer` turns a string that is a plain
integer (`"449"`, as JSONL problem sets often store answers) into an int, so a file's encoding does not change
how strictly a task is graded.

`math_equal(pred, ref)` decides whether two written answers denote the same value. It only rewrites strings
and compares exact rationals (`fractions.Fraction`, never floats); it never evaluates what it parses (no
`eval`, no sympy `sympify`, whose parser calls `eval`), because `pred` is model output. The rules, applied to
both sides alike:

1. Notation without value goes: `$...$`, `\\(...\\)`, `\\boxed{}`, the `\\text{}` / `\\mathrm{}` / `\\textbf{}`
   family (content kept), `\\left` / `\\right`, `\\$` and `$`, degrees (`^\\circ`, `^{\\circ}`, `°`), a leading
   `x =` (one variable, the only `=`), a trailing period, trailing units after a number (`5\\text{ cm}`, or
   words of two or more letters after a space: `5 cm`, `5 square units`; not `pi` or `million`, and one bare
   letter stays, `3 x` may be a product), and spacing (whitespace, `\\,` `\\;` `\\:` `\\!` `~`; between two digits only as a thousands
   separator, so `1 00` never becomes `100`).
2. Percent: `%` / `\\%` is a unit mark, removed from both sides like `cm`: `50\\%` equals `50` and `50\\%`
   (the answer to "what percent ..."). It never rescales: `50\\%` is not `0.5`, because a rule that sometimes
   divides by 100 would make a grade depend on how the reference happened to be written.
3. Numbers are exact rationals: integers with thousands separators in groups of three (`1,000`, `1 000`,
   `1\\,000`, `1{,}000`), decimals (`0.75`, `.75`, `0.750`), `a/b`, `\\frac{a}{b}` / `\\dfrac` / `\\tfrac` /
   `\\frac34`, with a minus sign in front, on the numerator or on the denominator. `0.33` is not `1/3`.
4. A bracketed list is a tuple or an interval, `(1, 2)`, `[0, 1)`: same brackets, same length, equal elements
   in order. A set `\\{1, 2\\}` or a bare list `1, 2` (the answer to "find all ...") matches in any order.
5. Anything else is a normalised string (rule 1, `\\dfrac` -> `\\frac`, `x^{2}` -> `x^2`, `\\sqrt2` ->
   `\\sqrt{2}`): `\\sqrt{2}`, `x^2+1`, `\\pi`. Equal values written as different expressions (`2\\sqrt{2}`,
   `\\sqrt{8}`; `2+2` and `4`; the mixed number `3\\frac{1}{2}`) are not recognised: a false negative, the price
   of never evaluating.

A prediction longer than `MAX_ANSWER_CHARS` is never equal (no reference answer of these benchmarks comes
close), which also bounds the work one comparison can cost.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

_INTEGER = re.compile(r"[+-]?\d+")
MAX_ANSWER_CHARS = 1000
"""Longer predictions are rejected unread: they are not answers, and this bounds the work per comparison."""
_MAX_DEPTH = 8
"""Nesting (tuples in tuples, fractions in fractions) beyond this compares unequal instead of recursing."""

_TEXT_WRAPPERS = (
    "\\text",
    "\\textbf",
    "\\textit",
    "\\textrm",
    "\\textnormal",
    "\\mathrm",
    "\\mathbf",
    "\\mathit",
    "\\mbox",
)
_WRAPPED_UNIT = re.compile(
    r"\\(?:text|textrm|textnormal|mathrm|mbox)\s*\{\s*[A-Za-z][A-Za-z .]*\}"
    r"(?:\^\{?[23]\}?)?\s*$"
)
_UNIT_WORD = re.compile(r"[A-Za-z]{2,}(?:\^\{?[23]\}?)?")
_VALUE_WORDS = frozenset({"pi", "inf", "infty", "infinity", "hundred", "thousand", "million", "billion", "trillion"})
"""Words that are or scale values, not units: `2 pi` keeps its `pi`, `1 million` is not 1."""
_DEGREES = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|°|\\degree(?![A-Za-z])")
_SIZING = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|bigg|Bigg)(?![A-Za-z])|\\displaystyle")
_VARIABLE = re.compile(r"\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*=")
_SPACE = r"(?:\\[,;:! ]|~|\s)"
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:(?:\{,\}|\\,|\\ |,|~|\s)\d{3})+(?:\.\d+)?")
_DIGIT_GAP = re.compile(rf"(?<=\d){_SPACE}+(?=\d)")
_SPACING = re.compile(rf"{_SPACE}+")
_SCRIPT = re.compile(r"([\^_])\{([A-Za-z0-9])\}")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_PAIRS = {"(": ")", "[": "]", "{": "}"}


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (braces matched), or None (no box, or the last one unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = _closing_brace(text, start + len("\\boxed"))
    return text[start + len("\\boxed{") : end] if end >= 0 else None


def reference_answer(answer: Any) -> Any:
    """A task's answer ready for `grade_answer`: a string that is a plain integer (`"449"`, `" -3 "`) becomes
    an int, so it is graded exactly like the int it stands for; anything else is returned unchanged."""
    if isinstance(answer, str) and _INTEGER.fullmatch(answer.strip()):
        return int(answer.strip())
    return answer


def grade_answer(text: str, answer: int | str | float) -> bool:
    """True when the last boxed answer of `text` is `answer`: exactly, for an int (surrounding spaces allowed);
    by `math_equal`, for a string or a float."""
    boxed = extract_boxed(text)
    if boxed is None:
        return False
    if isinstance(answer, int) and not isinstance(answer, bool):
        boxed = boxed.strip()
        return bool(_INTEGER.fullmatch(boxed)) and int(boxed) == answer
    return math_equal(boxed, answer)


def math_equal(pred: str | None, ref: str | int | float) -> bool:
    """True when `pred` and `ref` denote the same value though written differently (rules in the module
    docstring). `pred` is untrusted model output; None (no answer) is never equal.

    Raises:
        TypeError: `ref` is not a str, int or float (a bool is refused: it is no answer).
    """
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return False
    return _equal(_normalize(pred), _normalize(_reference_text(ref)), 0)


def _reference_text(ref: str | int | float) -> str:
    if isinstance(ref, bool) or not isinstance(ref, (str, int, float)):
        raise TypeError(f"ref: expected a str, int or float answer, got {type(ref).__name__}")
    if isinstance(ref, float):
        # repr is the shortest string that round-trips, so 0.1 stays 1/10 rather than the binary float's value.
        return format(Decimal(repr(ref)), "f") if ref == ref and abs(ref) != float("inf") else ""
    return str(ref)


def _closing_brace(text: str, open_at: int) -> int:
    """Index of the `}` matching the `{` at `open_at`, or -1 when it is never closed."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _unwrap(s: str, command: str) -> str:
    """`\\text{abc}` -> `abc` for every occurrence of `command`; an unclosed one is left as it is."""
    opener = command + "{"
    start = s.find(opener)
    while start >= 0:
        end = _closing_brace(s, start + len(command))
        if end < 0:
            return s
        s = s[:start] + s[start + len(opener) : end] + s[end + 1 :]
        start = s.find(opener, start)
    return s


def _strip_period(s: str) -> str:
    s = s.strip()
    while s.endswith("."):
        s = s[:-1].rstrip()
    return s


def _is_number(s: str) -> bool:
    return _to_fraction(_compact(s), 0) is not None


def _strip_unit(s: str) -> str:
    """`5\\text{ cm}` / `5 cm` / `5 square units` -> `5`; kept as it is unless what precedes the unit is a number."""
    wrapped = _WRAPPED_UNIT.search(s)
    if wrapped and _is_number(s[: wrapped.start()]):
        return s[: wrapped.start()].strip()
    words = s.split()
    keep = len(words)
    while keep > 1 and _UNIT_WORD.fullmatch(words[keep - 1]) and words[keep - 1] not in _VALUE_WORDS:
        keep -= 1
    if keep < len(words) and _is_number(" ".join(words[:keep])):
        return " ".join(words[:keep])
    return s


def _strip_variable(s: str) -> str:
    """`x = 5` / `a_1 = 5` / `\\theta = 5` -> `5`, only when that `=` is the only one."""
    match = _VARIABLE.match(s)
    if match and s.count("=") == 1 and s[match.end() :].strip():
        return s[match.end() :].strip()
    return s


def _normalize(s: str) -> str:
    """Rule 1 of the module docstring: notation without value removed, then `_compact`."""
    s = s.replace("\u2212", "-").replace("\\$", "").replace("$", "").strip()
    if s.startswith(("\\(", "\\[")) and s.endswith(("\\)", "\\]")):
        s = s[2:-2]
    s = _unwrap(_unwrap(s, "\\boxed"), "\\fbox")
    s = _SIZING.sub("", _DEGREES.sub("", s)).replace("\\%", "").replace("%", "")
    s = _strip_variable(_strip_period(s))
    s = _strip_unit(s)  # before the wrappers go: `5\text{m}` is a unit, `5m` may not be
    for command in _TEXT_WRAPPERS:
        s = _unwrap(s, command)
    s = _strip_unit(_strip_variable(_strip_period(s)))
    return _compact(s)


def _compact(s: str) -> str:
    """Spacing removed (thousands separators too, only in groups of three digits) and the spellings of one
    LaTeX form unified: `\\dfrac`/`\\tfrac` -> `\\frac`, `\\frac34` -> `\\frac{3}{4}`, `x^{2}` -> `x^2`."""
    s = s.strip()
    if _THOUSANDS.fullmatch(s):
        s = re.sub(r"\{,\}|\\,|\\ |,|~|\s", "", s)
    s = _SPACING.sub("", _DIGIT_GAP.sub("\x00", s)).replace("\x00", " ")  # a gap between digits stays one space
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    return _SCRIPT.sub(r"\1\2", s)


def _frac_argument(s: str, i: int) -> tuple[str, int] | None:
    """The argument of `\\frac` starting at `i` (a braced group or one character) and the index after it."""
    if i >= len(s):
        return None
    if s[i] == "{":
        end = _closing_brace(s, i)
        return (s[i + 1 : end], end + 1) if end >= 0 else None
    return s[i], i + 1


def _to_fraction(s: str, depth: int) -> Fraction | None:
    """The exact value of a compacted number (rule 3), or None when `s` is not one."""
    if not s or depth > _MAX_DEPTH or len(s) > MAX_ANSWER_CHARS:
        return None
    sign = -1 if s[0] == "-" else 1
    if s[0] in "+-":
        s = s[1:]
    if len(s) >= 2 and _PAIRS.get(s[0]) == s[-1] and _enclosed(s, 0):
        inner = _to_fraction(s[1:-1], depth + 1)
        return None if inner is None else sign * inner
    if _DECIMAL.fullmatch(s):
        return sign * Fraction(s)
    if s.startswith("\\frac"):
        first = _frac_argument(s, len("\\frac"))
        second = first and _frac_argument(s, first[1])
        if not second or second[1] != len(s):
            return None
        num, den = _to_fraction(first[0], depth + 1), _to_fraction(second[0], depth + 1)
        return None if num is None or not den else sign * num / den
    if s.count("/") == 1:
        a, b = s.split("/")
        num, den = _to_fraction(a, depth + 1), _to_fraction(b, depth + 1)
        return None if num is None or not den else sign * num / den
    return None


def _enclosed(s: str, start: int) -> bool:
    """True when the bracket at `start` closes at the last character (`(1,2)`, not `(1)+(2)`); any of `([{`
    opens and any of `)]}` closes, so half-open intervals `[0,1)` count."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] in "([{":
            depth += 1
        elif s[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i == len(s) - 1
    return False


def _split_top_level(body: str) -> list[str]:
    """`1,(2,3),4` -> `["1", "(2,3)", "4"]`; unbalanced brackets give `[body]` (no split)."""
    items, depth, begin = [], 0, 0
    for i, ch in enumerate(body):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return [body]
        elif ch == "," and depth == 0:
            items.append(body[begin:i])
            begin = i + 1
    return [body] if depth else items + [body[begin:]]


def _as_list(s: str) -> tuple[str, list[str], str] | None:
    """`(1,2]` -> `("(", ["1", "2"], "]")`, `\\{1,2\\}` -> `("\\{", [...], "\\}")`, `1,2` -> `("", [...], "")`;
    None when `s` has no top-level comma (a single value)."""
    if s.startswith("\\{") and s.endswith("\\}") and _enclosed(s, 1):
        opening, body, closing = "\\{", s[2:-2], "\\}"
    elif len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _enclosed(s, 0):
        opening, body, closing = s[0], s[1:-1], s[-1]
    else:
        opening, body, closing = "", s, ""
    items = _split_top_level(body)
    # each element compacted on its own: `(1{,}000, 2)` holds the number 1000
    return (opening, [_compact(x) for x in items], closing) if len(items) > 1 else None


def _equal(a: str, b: str, depth: int) -> bool:
    if not a or not b:
        return False
    if a == b:
        return True
    if depth > _MAX_DEPTH:
        return False
    list_a, list_b = _as_list(a), _as_list(b)
    if list_a or list_b:
        if not (list_a and list_b) or (list_a[0], list_a[2]) != (list_b[0], list_b[2]):
            return False
        items_a, items_b = list_a[1], list_b[1]
        if len(items_a) != len(items_b):
            return False
        if list_a[0] in ("", "\\{"):  # a set or a bare list: pair the elements up in any order
            unused = list(items_b)
            for x in items_a:
                match = next((i for i, y in enumerate(unused) if _equal(x, y, depth + 1)), None)
                if match is None:
                    return False
                unused.pop(match)
            return True
        return all(_equal(x, y, depth + 1) for x, y in zip(items_a, items_b))
    x, y = _to_fraction(a, 0), _to_fraction(b, 0)
    return x is not None and x == y
