"""The hand-written answer rules: string rewriting and exact rationals, no evaluation.

This was the project's whole grader before math-verify. `components.envs.grading` asks these rules first and
keeps them where they measured better than math-verify (docs/grading.md): exact numbers and lists of them
(math-verify rounds decimals, and reads a set as the interval with the same ends), a trailing full stop,
thousands separators inside a tuple. Rules 2 and 4 and the prose words of rule 1 were corrected by that
comparison.

`rules_equal(pred, ref)` decides whether two written answers denote the same value. It only rewrites strings
and compares exact rationals (`fractions.Fraction`, never floats); it never evaluates what it parses (no
`eval`, no sympy `sympify`, whose parser calls `eval`), because `pred` is model output. The rules, applied to
both sides alike:

1. Notation without value goes: `$...$`, `\\(...\\)`, `\\boxed{}`, the `\\text{}` / `\\mathrm{}` / `\\textbf{}`
   family (content kept), `\\left` / `\\right`, `\\$` and `$`, degrees (`^\\circ`, `^{\\circ}`, `°`), a leading
   `x =` (one variable, the only `=`), a trailing period, trailing units after a number (`5\\text{ cm}`, or
   words of two or more letters after a space: `5 cm`, `5 square units`; not `pi` or `million`, not words of
   prose, so `1 and odd prime numbers` is no number, and one bare letter stays, `3 x` may be a product), and
   spacing (whitespace, `\\,` `\\;` `\\:` `\\!` `~`; between two digits only as a thousands separator, so
   `1 00` never becomes `100`).
2. Percent: `%` / `\\%` is removed from both sides like a unit, so `50\\%` equals `50` and `50\\%` (the answer
   to "what percent ..."); and where only one side has it, that side may also be read as its value over 100, so
   `50\\%` equals `0.5` (75% is 3/4). Both readings are exact: `33.3333\\%` is not `1/3`.
3. Numbers are exact rationals: integers with thousands separators in groups of three (`1,000`, `1 000`,
   `1\\,000`, `1{,}000`), decimals (`0.75`, `.75`, `0.750`), `a/b`, `\\frac{a}{b}` / `\\dfrac` / `\\tfrac` /
   `\\frac34`, with a minus sign in front, on the numerator or on the denominator. `0.33` is not `1/3`.
4. A bracketed list is a tuple or an interval, `(1, 2)`, `[0, 1)`: same brackets, same length, equal elements
   in order. A set `\\{1, 2\\}` and a bare list `1, 2` (the answer to "find all ...") are the same kind and match
   in any order; neither equals the tuple or interval `(1, 2)`.
5. Anything else is a normalised string (rule 1, `\\dfrac` -> `\\frac`, `x^{2}` -> `x^2`, `\\sqrt2` ->
   `\\sqrt{2}`): `\\sqrt{2}`, `x^2+1`, `\\pi`. Equal values written as different expressions (`2\\sqrt{2}`,
   `\\sqrt{8}`; `2+2` and `4`; the mixed number `3\\frac{1}{2}`) are not recognised here: math-verify does that
   (`components.envs.grading`).

A prediction longer than `MAX_ANSWER_CHARS` is never equal (no reference answer of these benchmarks comes
close), which also bounds the work one comparison can cost.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

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
_PROSE_WORDS = frozenset(
    {"and", "or", "not", "all", "any", "every", "some", "no", "none", "if", "is", "are", "for", "when", "where"}
    | {"with", "of", "the", "only", "except", "excluding", "otherwise", "odd", "even", "prime", "primes"}
)
"""Words of an answer in prose, never of a unit: `1 and odd prime numbers` is not the number 1 (IMO-AnswerBench)."""
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


def exact_number(s: str) -> Fraction | None:
    """The exact value of an answer that rule 3 reads as a number after rule 1 (`\\$1{,}000`, `x = -\\frac34`,
    `0.75\\text{ m}`), else None (a list, an expression, a word, or longer than `MAX_ANSWER_CHARS`)."""
    if len(s) > MAX_ANSWER_CHARS:
        return None
    return _to_fraction(_normalize(s), 0)


def rules_equal(pred: str | None, ref: str | int | float) -> bool:
    """True when `pred` and `ref` denote the same value though written differently (rules in the module
    docstring). `pred` is untrusted model output; None (no answer) is never equal.

    Raises:
        TypeError: `ref` is not a str, int or float (a bool is refused: it is no answer).
    """
    ref = reference_text(ref)
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return False
    a, b = _normalize(pred), _normalize(ref)
    if _equal(a, b, 0):
        return True
    if _has_percent(pred) != _has_percent(ref):  # rule 2: one side's percent may also be its value over 100
        x, y = _to_fraction(a, 0), _to_fraction(b, 0)
        if x is not None and y is not None:
            return (x / 100 if _has_percent(pred) else x) == (y / 100 if _has_percent(ref) else y)
    return False


def is_numeric(s: str) -> bool:
    """True when rules 3 and 4 read all of `s` after rule 1: an exact number (`\\$1{,}000`, `x = -\\frac34`) or
    a list of them (`(0.5, 3/4)`, `\\{1, 2\\}`, nested too). Between two such answers `rules_equal` is complete:
    it compares exact values and the kinds of brackets, and needs no symbolic algebra."""
    return len(s) <= MAX_ANSWER_CHARS and _numeric(_normalize(s), 0)


def _numeric(s: str, depth: int) -> bool:
    listed = _as_list(s) if depth <= _MAX_DEPTH else None
    if listed:
        return all(_numeric(x, depth + 1) for x in listed[1])
    return _to_fraction(s, 0) is not None


def _has_percent(s: str) -> bool:
    return "%" in s


def reference_text(ref: str | int | float) -> str:
    """A reference answer as text: a str as it is, an int in digits, a float by its shortest decimal (NaN and
    infinities: empty, which equals nothing).

    Raises:
        TypeError: `ref` is not a str, int or float (a bool is refused: it is no answer).
    """
    if isinstance(ref, bool) or not isinstance(ref, (str, int, float)):
        raise TypeError(f"ref: expected a str, int or float answer, got {type(ref).__name__}")
    if isinstance(ref, float):
        # repr is the shortest string that round-trips, so 0.1 stays 1/10 rather than the binary float's value.
        return format(Decimal(repr(ref)), "f") if ref == ref and abs(ref) != float("inf") else ""
    return str(ref)


def closing_brace(text: str, open_at: int) -> int:
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
        end = closing_brace(s, start + len(command))
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
    while (
        keep > 1
        and _UNIT_WORD.fullmatch(words[keep - 1])
        and words[keep - 1].lower() not in _VALUE_WORDS | _PROSE_WORDS
    ):
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
        end = closing_brace(s, i)
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


def _kind(listed: tuple[str, list[str], str]) -> str:
    """`set` for a set or a bare list (both unordered: `\\{1, 2\\}` is `1, 2`), else the brackets, `(]`."""
    return "set" if listed[0] in ("", "\\{") else listed[0] + listed[2]


def _equal(a: str, b: str, depth: int) -> bool:
    if not a or not b:
        return False
    if a == b:
        return True
    if depth > _MAX_DEPTH:
        return False
    list_a, list_b = _as_list(a), _as_list(b)
    if list_a or list_b:
        if not (list_a and list_b) or _kind(list_a) != _kind(list_b):
            return False
        items_a, items_b = list_a[1], list_b[1]
        if len(items_a) != len(items_b):
            return False
        if _kind(list_a) == "set":  # pair the elements up in any order
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
