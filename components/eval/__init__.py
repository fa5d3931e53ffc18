"""Evaluation: benchmark loaders (`benchmarks`), answer grading and the evaluation loop (`evaluate`).

The graders live in `components.envs.grading`, because the environment grades each episode; they are
re-exported here for evaluation code. `evaluate` is not imported here: it pulls in the agent runner.
"""

from components.envs.grading import extract_boxed, grade_answer, math_equal
from components.eval.benchmarks import (
    BENCHMARKS,
    BenchmarkFormat,
    detect_benchmark,
    load_benchmark,
)

__all__ = [
    "BENCHMARKS",
    "BenchmarkFormat",
    "detect_benchmark",
    "extract_boxed",
    "grade_answer",
    "load_benchmark",
    "math_equal",
]
