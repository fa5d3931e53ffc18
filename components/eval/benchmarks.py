"""Benchmark loaders: AIME 2025, HMMT February 2025, BeyondAIME and IMO-AnswerBench files as `Task` lists.

The files are the user's: nothing is downloaded here. A benchmark is read as its public release ships it
(JSONL or Parquet, and the CSV that IMO-AnswerBench publishes) from a local path or an `s3://bucket/key` URI,
through `components.data.problem_sets` (`read_rows`, and `read_bytes` for CSV). `load_tasks` is not reused: a
benchmark's columns have several accepted names, resolved from the rows, and its errors name the benchmark.

Each task keeps the release's reference answer (`Task.answer`: an int stays an int, a string is stripped of
surrounding whitespace and otherwise kept as written, e.g. `\\frac{3}{4}`) and every other column in
`Task.metadata` (the id column too), plus `metadata["benchmark"]`, the format's name. Ids come from the
release's id column; a bare problem number (`problem_idx` 7) becomes `<benchmark>-7`, so that two benchmarks
can share one evaluation; without an id column the id is `<benchmark>-<row>` (row counted from 0).

Column names of the public releases, looked up with the search tool (docs and code corpora):

- aime2025, `MathArena/aime_2025` (Hugging Face, Parquet): `problem_idx` (int), `problem`, `answer`,
  `problem_type` (list of str). The card of aime_2025 itself was not found; the schema is that of its
  publisher's sibling cards, `MathArena/aime_2024_I` (`problem_idx`, `problem`, `answer` as int64) and
  `MathArena/final_answer_comps` ("includes AIME 2025, HMMT 2025 ...": `problem_idx`, `answer`,
  `problem_type`, `problem`, `competition`, `source`).
- hmmt, `MathArena/hmmt_feb_2025`: the same schema (card of `MathArena/hmmt_feb_2026`: `problem_idx` int64,
  `answer` string, `problem_type` list[string], `problem` string), `answer` often LaTeX (`\\frac{...}`).
- beyondaime, `ByteDance-Seed/BeyondAIME` (split `test`): `problem`, `answer`, no id column (code that loads
  it: NVIDIA NeMo-Skills `nemo_skills/dataset/beyond-aime/prepare.py`, which renames `answer` to
  `expected_answer` when it writes JSONL; that name is accepted too). Its card was not found.
- imoanswerbench, google-deepmind/superhuman `imobench/answerbench.csv` (header read from the file):
  `Problem ID` (`imo-bench-algebra-001`), `Problem`, `Short Answer`, `Category`, `Level`, `Subcategory`,
  `Source`; `imobench/hf_dataset_cards/answerbench.md` lists the same columns.

Every format also accepts the common aliases: prompt `problem` / `question` / `Problem`, answer `answer` /
`expected_answer` / `Short Answer`, id `id` / `problem_idx` / `Problem ID`; its own release's names come first.

`detect_benchmark` (and the name `"auto"`) picks the format whose release columns best match the file's
(Jaccard similarity of the column sets). AIME 2025 and HMMT ship identical columns; between them the file
name decides (`hmmt` / `aime`), then the answers (AIME answers are integers 0-999 by the competition's rules).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from components.contracts.task import Task
from components.data.problem_sets import read_bytes, read_rows

_PROMPTS = ("problem", "question", "Problem")
_ANSWERS = ("answer", "expected_answer", "Short Answer")
_IDS = ("id", "problem_idx", "Problem ID")


def _first(own: str, aliases: tuple[str, ...]) -> tuple[str, ...]:
    return (own,) + tuple(a for a in aliases if a != own)


@dataclass(frozen=True)
class BenchmarkFormat:
    name: str
    """Key in `BENCHMARKS`, `Task.metadata["benchmark"]` and the prefix of generated ids."""
    release: str
    """Where the public release lives (named in errors)."""
    columns: frozenset[str]
    """The release's columns, which `detect_benchmark` matches a file against."""
    prompt_fields: tuple[str, ...]
    """Accepted names of the problem column, the first present one wins."""
    answer_fields: tuple[str, ...]
    """Accepted names of the reference answer column."""
    id_fields: tuple[str, ...]
    """Accepted names of the id column; none present: ids are `<name>-<row>`."""
    file_hints: tuple[str, ...]
    """Substrings of a file name that point to this benchmark (a tie-break in detection)."""
    integer_answers: bool = False
    """Every answer is an integer 0-999 (AIME's rule; a tie-break in detection)."""


_MATHARENA = frozenset({"problem_idx", "problem", "answer", "problem_type"})

BENCHMARKS: dict[str, BenchmarkFormat] = {
    "aime2025": BenchmarkFormat(
        "aime2025",
        "MathArena/aime_2025",
        _MATHARENA,
        _PROMPTS,
        _ANSWERS,
        _first("problem_idx", _IDS),
        ("aime",),
        integer_answers=True,
    ),
    "hmmt": BenchmarkFormat(
        "hmmt", "MathArena/hmmt_feb_2025", _MATHARENA, _PROMPTS, _ANSWERS, _first("problem_idx", _IDS), ("hmmt",)
    ),
    "beyondaime": BenchmarkFormat(
        "beyondaime",
        "ByteDance-Seed/BeyondAIME",
        frozenset({"problem", "answer"}),
        _PROMPTS,
        _ANSWERS,
        _IDS,
        ("beyond",),
    ),
    "imoanswerbench": BenchmarkFormat(
        "imoanswerbench",
        "google-deepmind/superhuman imobench/answerbench.csv",
        frozenset({"Problem ID", "Problem", "Short Answer", "Category", "Level", "Subcategory", "Source"}),
        _first("Problem", _PROMPTS),
        _first("Short Answer", _ANSWERS),
        _first("Problem ID", _IDS),
        ("imo", "answerbench"),
    ),
}
"""The benchmark formats by name; `load_benchmark` also takes `"auto"`."""


def read_benchmark_rows(uri: str) -> list[dict[str, Any]]:
    """Rows of a benchmark file: `.csv` (header row, every value a string) here, JSONL/Parquet via `read_rows`."""
    if uri.lower().endswith(".csv"):
        text = read_bytes(uri).decode("utf-8-sig")  # -sig: a spreadsheet's byte-order mark is not a column name
        return [dict(row) for row in csv.DictReader(io.StringIO(text, newline=""))]
    return read_rows(uri)


def _columns(rows: list[dict[str, Any]]) -> set[str]:
    return {key for row in rows for key in row}


def _pick(fields: tuple[str, ...], columns: set[str]) -> str | None:
    return next((f for f in fields if f in columns), None)


def _is_small_integer(value: Any) -> bool:
    text = str(value).strip()
    return text.isdigit() and int(text) <= 999


def _detect(uri: str, rows: list[dict[str, Any]]) -> BenchmarkFormat:
    columns = _columns(rows)
    readable = [f for f in BENCHMARKS.values() if _pick(f.prompt_fields, columns) and _pick(f.answer_fields, columns)]
    if not readable:
        raise ValueError(
            f"{uri}: no benchmark format fits its columns {sorted(columns)}; a problem column "
            f"({' / '.join(_PROMPTS)}) and an answer column ({' / '.join(_ANSWERS)}) are needed"
        )

    def similarity(f: BenchmarkFormat) -> float:
        return len(f.columns & columns) / len(f.columns | columns)

    best = max(map(similarity, readable))
    tied = [f for f in readable if similarity(f) == best]
    stem = PurePosixPath(uri).stem.lower()
    hinted = [f for f in tied if any(h in stem for h in f.file_hints)]
    if len(hinted) > 1:  # "beyondaime" holds "aime" too: the longest hint is the most specific
        longest = max(len(h) for f in hinted for h in f.file_hints if h in stem)
        hinted = [f for f in hinted if any(len(h) == longest and h in stem for h in f.file_hints)]
    tied = hinted or tied
    if len(tied) > 1:
        answer = _pick(tied[0].answer_fields, columns)
        integers = all(_is_small_integer(row.get(answer)) for row in rows)
        tied = [f for f in tied if f.integer_answers == integers] or tied
    return tied[0]


def detect_benchmark(uri: str | PurePosixPath) -> str:
    """The name of the benchmark format whose public release's columns best match the file (module docstring)."""
    uri = str(uri)
    return _detect(uri, read_benchmark_rows(uri)).name


def _empty(value: Any) -> bool:
    # 0 is a real answer; only absent or blank values count as missing.
    return value is None or (isinstance(value, str) and not value.strip())


def _task_id(fmt: BenchmarkFormat, value: Any, row: int) -> str:
    if value is None:
        return f"{fmt.name}-{row}"
    text = str(value).strip()
    return f"{fmt.name}-{text}" if text.isdigit() else text


def _to_tasks(fmt: BenchmarkFormat, uri: str, rows: list[dict[str, Any]]) -> list[Task]:
    columns = _columns(rows)
    prompt_field, answer_field = _pick(fmt.prompt_fields, columns), _pick(fmt.answer_fields, columns)
    id_field = _pick(fmt.id_fields, columns)
    for role, field, names in (
        ("problem", prompt_field, fmt.prompt_fields),
        ("answer", answer_field, fmt.answer_fields),
    ):
        if rows and field is None:
            raise ValueError(
                f"{fmt.name}: {uri}: no {role} column; expected one of {list(names)} "
                f"(as in {fmt.release}), found {sorted(columns)}"
            )
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        for field in (prompt_field, answer_field, id_field):
            if field is not None and _empty(row.get(field)):
                raise ValueError(f"{fmt.name}: {uri}: row {i}: field {field!r} is missing or empty")
        prompt, answer = row[prompt_field], row[answer_field]
        if not isinstance(prompt, str):
            raise ValueError(
                f"{fmt.name}: {uri}: row {i}: field {prompt_field!r} must be a string, got {type(prompt).__name__}"
            )
        task_id = _task_id(fmt, row.get(id_field) if id_field else None, i)
        if task_id in seen:
            raise ValueError(
                f"{fmt.name}: {uri}: row {i}: field {id_field!r}: id {task_id!r} repeats row {seen[task_id]}"
            )
        seen[task_id] = i
        metadata = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
        metadata["benchmark"] = fmt.name
        tasks.append(Task(task_id, prompt, answer.strip() if isinstance(answer, str) else answer, metadata))
    return tasks


def load_benchmark(name: str, uri: str | PurePosixPath, limit: int | None = None) -> list[Task]:
    """Load a benchmark file as tasks.

    Args:
        name: a key of `BENCHMARKS` (`aime2025`, `hmmt`, `beyondaime`, `imoanswerbench`) or `auto`
            (`detect_benchmark`).
        uri: local path or `s3://bucket/key`; `.jsonl`/`.ndjson`, `.parquet`/`.pq` or `.csv`.
        limit: keep only the first `limit` rows (only those are validated).

    Raises:
        ValueError: unknown name; no problem/answer column; a row whose problem, answer or id is missing or
            empty, a problem that is not a string, or a repeated id. The message names the benchmark, the
            row (counted from 0) and the field.
        FileNotFoundError: the file or object does not exist.
    """
    if name != "auto" and name not in BENCHMARKS:
        raise ValueError(f"benchmark: unknown name {name!r}; expected one of {sorted(BENCHMARKS)} or 'auto'")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    uri = str(uri)
    rows = read_benchmark_rows(uri)
    fmt = _detect(uri, rows) if name == "auto" else BENCHMARKS[name]
    return _to_tasks(fmt, uri, rows if limit is None else rows[:limit])
