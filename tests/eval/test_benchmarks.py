"""Benchmark loaders on small made-up files in each public release's format: JSONL, Parquet and CSV, local
and on S3 (the real moto server over HTTP), format detection, bad rows named, and grading end to end."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.envs.grading import extract_boxed, grade_answer, math_equal, reference_answer
from components.eval import BENCHMARKS, detect_benchmark, load_benchmark

# MathArena schema (aime_2025, hmmt_feb_2025): problem_idx, problem, answer, problem_type. Made-up problems.
AIME_ROWS = [
    {
        "problem_idx": 1,
        "problem": "How many positive divisors does 36 have?",
        "answer": 9,
        "problem_type": ["Number Theory"],
    },
    {"problem_idx": 2, "problem": "Compute 12 times 13.", "answer": 156, "problem_type": ["Algebra"]},
    {"problem_idx": 3, "problem": "Compute 7 minus 7.", "answer": 0, "problem_type": ["Algebra", "Combinatorics"]},
]
HMMT_ROWS = [
    {"problem_idx": 1, "problem": "What is 3 divided by 4?", "answer": "\\frac{3}{4}", "problem_type": ["Algebra"]},
    {"problem_idx": 2, "problem": "Give the point (1, 2).", "answer": "(1, 2)", "problem_type": ["Geometry"]},
    {"problem_idx": 3, "problem": "Compute 3 times 4.", "answer": " 12 ", "problem_type": ["Algebra"]},
]
# ByteDance-Seed/BeyondAIME: problem, answer; no id column.
BEYOND_ROWS = [{"problem": f"Compute {a} plus {b}.", "answer": str(a + b)} for a, b in ((100, 23), (400, 56), (7, 8))]
# google-deepmind IMO-AnswerBench answerbench.csv header.
IMO_HEADER = ["Problem ID", "Problem", "Short Answer", "Category", "Level", "Subcategory", "Source"]
IMO_ROWS = [
    [
        "imo-bench-algebra-001",
        "Find all $n$ with $n^2 = 9$ and $n > 0$.\n",
        "3",
        "Algebra",
        "IMO-Easy",
        "Equation",
        "Made up",
    ],
    [
        "imo-bench-number_theory-002",
        "Find $u$ such that\n\n\\[2^{u} = 4.\\]\n",
        "$2$ ",
        "Number theory",
        "pre-IMO",
        "Exponent",
        "Made up",
    ],
    [
        "imo-bench-combinatorics-003",
        "Give all values of $k$ in $\\{1, 2\\}$.",
        "1, 2",
        "Combinatorics",
        "IMO-Medium",
        "Counting",
        "Made up",
    ],
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_imo_csv(path, rows=IMO_ROWS):
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(IMO_HEADER)
        writer.writerows(rows)
    return path


def test_aime2025_parquet(tmp_path):
    tasks = load_benchmark("aime2025", write_parquet(tmp_path / "aime_2025.parquet", AIME_ROWS))
    # problem_idx 1..3 -> aime2025-1..3; int answers stay ints (0 is a real answer, not a missing one)
    assert [(t.task_id, t.prompt, t.answer) for t in tasks] == [
        ("aime2025-1", AIME_ROWS[0]["problem"], 9),
        ("aime2025-2", AIME_ROWS[1]["problem"], 156),
        ("aime2025-3", AIME_ROWS[2]["problem"], 0),
    ]
    assert tasks[2].metadata == {
        "problem_idx": 3,
        "problem_type": ["Algebra", "Combinatorics"],
        "benchmark": "aime2025",
    }


def test_hmmt_jsonl_and_parquet_agree(tmp_path):
    from_jsonl = load_benchmark("hmmt", write_jsonl(tmp_path / "hmmt_feb_2025.jsonl", HMMT_ROWS))
    from_parquet = load_benchmark("hmmt", write_parquet(tmp_path / "hmmt_feb_2025.parquet", HMMT_ROWS))
    assert from_jsonl == from_parquet
    # LaTeX answers kept as written; " 12 " loses its surrounding spaces only
    assert [(t.task_id, t.answer) for t in from_jsonl] == [
        ("hmmt-1", "\\frac{3}{4}"),
        ("hmmt-2", "(1, 2)"),
        ("hmmt-3", "12"),
    ]
    assert from_jsonl[1].metadata == {"problem_idx": 2, "problem_type": ["Geometry"], "benchmark": "hmmt"}


def test_beyondaime_jsonl_without_ids_and_the_nemo_skills_answer_name(tmp_path):
    tasks = load_benchmark("beyondaime", write_jsonl(tmp_path / "test.jsonl", BEYOND_ROWS))
    # no id column: <benchmark>-<row>, rows counted from 0; 100+23 = 123, 400+56 = 456, 7+8 = 15
    assert [(t.task_id, t.answer, t.metadata) for t in tasks] == [
        ("beyondaime-0", "123", {"benchmark": "beyondaime"}),
        ("beyondaime-1", "456", {"benchmark": "beyondaime"}),
        ("beyondaime-2", "15", {"benchmark": "beyondaime"}),
    ]
    renamed = [{"problem": r["problem"], "expected_answer": r["answer"]} for r in BEYOND_ROWS]
    assert load_benchmark("beyondaime", write_jsonl(tmp_path / "nemo.jsonl", renamed)) == tasks


def test_imoanswerbench_csv_and_parquet(tmp_path):
    tasks = load_benchmark("imoanswerbench", write_imo_csv(tmp_path / "answerbench.csv"))
    # ids are the release's own; the multi-line quoted problem survives; "$2$ " loses its trailing space
    assert [(t.task_id, t.answer) for t in tasks] == [
        ("imo-bench-algebra-001", "3"),
        ("imo-bench-number_theory-002", "$2$"),
        ("imo-bench-combinatorics-003", "1, 2"),
    ]
    assert tasks[1].prompt == "Find $u$ such that\n\n\\[2^{u} = 4.\\]\n"
    assert tasks[0].metadata == {
        "Problem ID": "imo-bench-algebra-001",
        "Category": "Algebra",
        "Level": "IMO-Easy",
        "Subcategory": "Equation",
        "Source": "Made up",
        "benchmark": "imoanswerbench",
    }
    as_dicts = [dict(zip(IMO_HEADER, row)) for row in IMO_ROWS]
    assert load_benchmark("imoanswerbench", write_parquet(tmp_path / "answerbench.parquet", as_dicts)) == tasks


def test_detect_benchmark(tmp_path):
    assert detect_benchmark(write_imo_csv(tmp_path / "data.csv")) == "imoanswerbench"
    # {problem, answer} is BeyondAIME's exact column set (Jaccard 1 against 2/4 for MathArena's)
    assert detect_benchmark(write_jsonl(tmp_path / "set.jsonl", BEYOND_ROWS)) == "beyondaime"
    # AIME and HMMT ship the same columns: the file name decides ...
    assert detect_benchmark(write_parquet(tmp_path / "hmmt_feb_2025.parquet", AIME_ROWS)) == "hmmt"
    assert detect_benchmark(write_parquet(tmp_path / "aime_2025.parquet", HMMT_ROWS)) == "aime2025"
    # ... then the answers: all integers 0-999 is AIME, a LaTeX answer is not
    assert detect_benchmark(write_parquet(tmp_path / "a.parquet", AIME_ROWS)) == "aime2025"
    assert detect_benchmark(write_parquet(tmp_path / "b.parquet", HMMT_ROWS)) == "hmmt"
    auto = load_benchmark("auto", tmp_path / "b.parquet", limit=2)
    assert [(t.task_id, t.metadata["benchmark"]) for t in auto] == [("hmmt-1", "hmmt"), ("hmmt-2", "hmmt")]
    with pytest.raises(ValueError, match=r"no benchmark format fits its columns \['prompt', 'solution'\]"):
        detect_benchmark(write_jsonl(tmp_path / "other.jsonl", [{"prompt": "p", "solution": "s"}]))


def test_bad_files_name_the_benchmark_row_and_field(tmp_path):
    rows = HMMT_ROWS[:2] + [{"problem_idx": 3, "problem": "Compute 1+1.", "answer": None}]
    with pytest.raises(ValueError, match=r"hmmt: .*bad\.parquet: row 2: field 'answer' is missing or empty"):
        load_benchmark("hmmt", write_parquet(tmp_path / "bad.parquet", rows))
    assert len(load_benchmark("hmmt", tmp_path / "bad.parquet", limit=2)) == 2  # only kept rows are validated
    no_answer = [{"problem_idx": 1, "problem": "p"}]
    with pytest.raises(ValueError, match=r"aime2025: .*: no answer column; expected one of \['answer', "):
        load_benchmark("aime2025", write_jsonl(tmp_path / "none.jsonl", no_answer))
    imo = [IMO_ROWS[0], ["imo-bench-algebra-002", "   ", "4", "Algebra", "IMO-Easy", "Equation", "Made up"]]
    with pytest.raises(ValueError, match=r"imoanswerbench: .*: row 1: field 'Problem' is missing or empty"):
        load_benchmark("imoanswerbench", write_imo_csv(tmp_path / "blank.csv", imo))
    twice = [AIME_ROWS[0], dict(AIME_ROWS[1], problem_idx=1)]
    with pytest.raises(ValueError, match=r"aime2025: .*: row 1: field 'problem_idx': id 'aime2025-1' repeats row 0"):
        load_benchmark("aime2025", write_jsonl(tmp_path / "twice.jsonl", twice))
    with pytest.raises(ValueError, match=r"benchmark: unknown name 'aime'; expected one of \['aime2025', 'beyondaime'"):
        load_benchmark("aime", tmp_path / "twice.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_benchmark("hmmt", tmp_path / "missing.jsonl")
    assert sorted(BENCHMARKS) == ["aime2025", "beyondaime", "hmmt", "imoanswerbench"]


def test_load_through_s3(s3_env, tmp_path):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_env)
    client.create_bucket(Bucket="benchmarks")
    client.put_object(
        Bucket="benchmarks", Key="imo/answerbench.csv", Body=write_imo_csv(tmp_path / "answerbench.csv").read_bytes()
    )
    client.put_object(
        Bucket="benchmarks",
        Key="matharena/aime_2025.parquet",
        Body=write_parquet(tmp_path / "aime_2025.parquet", AIME_ROWS).read_bytes(),
    )
    assert load_benchmark("imoanswerbench", "s3://benchmarks/imo/answerbench.csv") == load_benchmark(
        "imoanswerbench", tmp_path / "answerbench.csv"
    )
    from_s3 = load_benchmark("auto", "s3://benchmarks/matharena/aime_2025.parquet")
    assert [(t.task_id, t.answer) for t in from_s3] == [("aime2025-1", 9), ("aime2025-2", 156), ("aime2025-3", 0)]


def test_end_to_end_grading_of_boxed_outputs(tmp_path):
    tasks = load_benchmark("auto", write_jsonl(tmp_path / "hmmt_tiny.jsonl", HMMT_ROWS))
    outputs = {  # per task: (a right answer written differently, a wrong one)
        "hmmt-1": ("so \\boxed{0.75}", "so \\boxed{\\frac{4}{3}}"),  # 0.75 = 3/4; 4/3 != 3/4
        "hmmt-2": ("\\boxed{\\left( 1,2 \\right)}", "\\boxed{(2, 1)}"),  # the tuple (1, 2); order matters
        "hmmt-3": ("\\boxed{12}", "\\boxed{12.5}"),  # "12" is a plain integer: exact, 12.5 is not 12
    }
    graded = {t.task_id: [grade_answer(text, reference_answer(t.answer)) for text in outputs[t.task_id]] for t in tasks}
    assert graded == {"hmmt-1": [True, False], "hmmt-2": [True, False], "hmmt-3": [True, False]}
    # the same verdicts straight from math_equal on the boxed text
    assert all(
        math_equal(extract_boxed(right), t.answer) and not math_equal(extract_boxed(wrong), t.answer)
        for t in tasks
        for right, wrong in [outputs[t.task_id]]
    )
