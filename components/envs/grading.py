"""Exact-answer grading of `\\boxed{}` answers."""

from __future__ import annotations

import re

_INTEGER = re.compile(r"[+-]?\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    begin = i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def grade_answer(text: str, answer: int) -> bool:
    """True when the last boxed answer is exactly the integer `answer` (surrounding spaces allowed)."""
    boxed = extract_boxed(text)
    if boxed is None:
        return False
    boxed = boxed.strip()
    return bool(_INTEGER.fullmatch(boxed)) and int(boxed) == answer
