"""math-verify behind a deadline: verdicts from any thread, a late comparison killed and the worker restarted, a
dead worker replaced, the worker's line protocol, and no text of an answer reaching `eval` in the worker."""

from __future__ import annotations

import builtins
import io
import json
import re
import threading
import time

import pytest

from components.envs.math_verifier import Verifier
from components.envs.math_verifier_worker import serve, verify_equal_here


@pytest.fixture
def verifier():
    v = Verifier(timeout_s=5.0)
    yield v
    v.close()


def test_verdicts_from_threads_off_the_main_one(verifier):
    # math-verify's own limits use signal.alarm and raise off the main thread; the worker process has none
    pairs = {
        ("\\sqrt{8}", "2\\sqrt{2}"): True,  # sqrt(8) = 2 sqrt(2)
        ("3\\frac{1}{2}", "\\frac{7}{2}"): True,  # 3 + 1/2 = 7/2
        ("\\sqrt{6}", "2\\sqrt{2}"): False,  # 6 != 8 under the root
        ("0.333333", "\\frac{1}{3}"): False,  # decimals are exact: 333333/1000000 != 1/3
    }
    results: dict = {}

    def grade(pair):
        results[pair] = verifier.verify_equal(*pair)

    threads = [threading.Thread(target=grade, args=(pair,)) for pair in pairs for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == pairs
    assert verifier.restarts == 0


def test_a_late_comparison_is_killed_and_the_worker_restarts():
    v = Verifier(timeout_s=0.5)
    try:
        assert v.verify_equal("1", "1") is True  # the worker is up
        start = time.monotonic()
        # 2^(2^(2^(2^1024))) has no end in sympy: no verdict after the 0.5 s deadline, and the worker is killed
        assert v.verify_equal("2^{2^{2^{2^{2^{10}}}}}", "3") is None
        assert 0.5 <= time.monotonic() - start < 2.0
        assert v.restarts == 1
        assert v.verify_equal("\\frac{6}{8}", "\\frac{3}{4}") is True  # a new worker answers
    finally:
        v.close()


def test_a_dead_worker_is_replaced(verifier):
    assert verifier.verify_equal("1", "1") is True
    verifier._proc.kill()  # the worker died between two calls (an out-of-memory kill, say)
    verifier._proc.wait()
    assert verifier.verify_equal("\\sqrt{4}", "2") is True  # sqrt(4) = 2, from a new worker
    assert verifier.restarts == 1


def test_timeouts_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s and start_timeout_s must be > 0, got 0, 60"):
        Verifier(timeout_s=0, start_timeout_s=60)


def test_worker_protocol_one_json_line_each_way():
    requests = [{"gold": "\\frac{1}{2}", "pred": "0.5"}, {"gold": "(1, 2)", "pred": "(2, 1)"}]
    out = io.StringIO()
    serve(io.StringIO("".join(json.dumps(r) + "\n" for r in requests)), out)
    # ready, then 1/2 = 0.5, then the tuple (2, 1) is not (1, 2)
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [
        {"ready": True},
        {"equal": True},
        {"equal": False},
    ]
    with pytest.raises(TypeError, match="gold and pred must be strings, got int, str"):
        serve(io.StringIO(json.dumps({"gold": 1, "pred": "1"}) + "\n"), io.StringIO())


def test_no_text_of_an_answer_reaches_eval(tmp_path, monkeypatch):
    # sympy turns the number tokens of the LaTeX parser into numbers through eval ("Integer (2 )"); nothing else
    # of an answer may get there. Every eval/exec/compile source is recorded while the worker's function grades.
    marker = tmp_path / "executed"
    payload = f"__import__('os').system('touch {marker}')"
    sources = []
    for name in ("eval", "exec", "compile"):
        original = getattr(builtins, name)

        def record(source, *args, _original=original, **kwargs):
            sources.append(source if isinstance(source, str) else "<code object>")
            return _original(source, *args, **kwargs)

        monkeypatch.setattr(builtins, name, record)
    verdicts = [
        verify_equal_here("0", text)
        for text in (payload, f"({payload}, 1)", f"x = {payload}", "eval('1+1')", "lambda: 0", "\\sqrt{8}")
    ]
    monkeypatch.undo()
    assert verdicts == [False] * 6
    assert not marker.exists()
    # what sympy runs: its namespace import, number tokens, unit names of letters (sympy.physics.units, loaded on
    # first use), generated monomial helpers, module code objects; never a bracket, a dot call or a quote of ours
    ours = re.compile(
        r"from sympy import \*|(Integer|Float) \([\d.' ]*\)|Symbol \('[A-Za-z]+' \)|E|def monomial_\w+\(.*|<code object>",
        re.S,
    )
    assert [s for s in sources if not ours.fullmatch(s.strip())] == []
