"""The math-verify process: `python -m components.envs.math_verifier_worker` reads one JSON request per line on stdin,
`{"gold": "...", "pred": "..."}`, and answers one line on stdout, `{"equal": true}` (or `false`).

math-verify (Hugging Face, 0.9.0) parses LaTeX into sympy and compares values symbolically and numerically. It
runs in a process of its own, driven by `components.envs.math_verifier`, for two reasons:

- Its time limits use `signal.alarm`, which works only on the main thread (off it, `parse` and `verify` raise
  ValueError), and the environments grade inside asyncio and worker threads. Here it runs on this process's main
  thread with its own limits off; the driving process bounds each comparison by a deadline and kills this
  process when one runs over, which no thread could do to a sympy computation stuck in C or in a long loop.
- A pathological answer (a huge power, a deep nesting) costs this process its memory or its life, not the
  trainer's: the address space is capped at `MEMORY_BYTES`.

Only `LatexExtractionConfig` is used. `ExprExtractionConfig` parses with sympy's `parse_expr`, which calls `eval`
on the text, and the prediction is model output. Both sides are handed over as `\\boxed{...}` content, so the
extraction reads exactly the answer `extract_boxed` found and nothing else of the turn.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from functools import lru_cache

import sympy
from math_verify import LatexExtractionConfig, parse, verify

MEMORY_BYTES = 4 << 30
"""Address-space cap of this process (sympy and the ANTLR parser take about 300 MB)."""


@lru_cache(maxsize=256)
def _parse(answer: str) -> tuple:
    answer = answer.strip().rstrip(".").rstrip()  # a sentence's full stop: math-verify reads `2.` as no number
    parsed = parse(f"\\boxed{{{answer}}}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    return tuple(_exact(x) for x in parsed)


def _exact(value):
    """Every decimal in `value` made the rational it writes (`0.333333` -> 333333/1000000). math-verify rounds a
    comparison with a float to 6 places, so `0.333333` would equal `\\frac{1}{3}` and `2.414214` would equal
    `1+\\sqrt{2}`; an approximation is not the exact answer the benchmarks ask for (docs/grading.md)."""
    if isinstance(value, sympy.Basic):
        floats = value.atoms(sympy.Float)
        if floats:
            return value.xreplace({f: sympy.Rational(str(f)) for f in floats})
    return value


def verify_equal_here(gold: str, pred: str) -> bool:
    """math-verify's verdict on `pred` against `gold` (the contents of two `\\boxed{}`), in this thread and without
    a time limit (the caller's to bound). Parses are cached: the samples of one task share their reference."""
    gold_parsed, pred_parsed = _parse(gold), _parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=None))


def serve(stdin, stdout) -> None:
    """Answer requests until stdin closes: one JSON line in, one out. A request that is not a JSON object with
    string `gold` and `pred` ends the process with a message on stderr (the driver sent it, so it is a bug)."""
    stdout.write(json.dumps({"ready": True}) + "\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)
        gold, pred = request["gold"], request["pred"]
        if not (isinstance(gold, str) and isinstance(pred, str)):
            raise TypeError(
                f"math_verifier_worker: gold and pred must be strings, got {type(gold).__name__}, {type(pred).__name__}"
            )
        stdout.write(json.dumps({"equal": verify_equal_here(gold, pred)}) + "\n")
        stdout.flush()


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    # math-verify warns once that its time limits are off (they are, on purpose) and logs every parse failure.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
    serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
