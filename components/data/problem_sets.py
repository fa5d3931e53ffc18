"""Real problem sets as `Task` lists: JSONL or Parquet, from a local path or an `s3://bucket/key` URI.

One row is one task. The prompt and answer columns are named by the caller; an optional id column gives
stable ids (default `<file stem>-<row>`, the row counted from 0 among non-blank rows); every other column
goes to `Task.metadata`. A row with a missing or empty prompt or answer is an error naming the row and the
field: a bad problem set is never silently shortened.

A `reasoning-gym:<dataset>?...` location is a generated set instead (components/data/reasoning_gym_tasks.py).

S3 objects are read through the artifact store's S3 client (components/storage/stores.py `read_uri`: retries,
bounded timeouts; boto3 imported only for `s3://` URIs). The endpoint comes from `AWS_ENDPOINT_URL_S3` or
`AWS_ENDPOINT_URL` when set (MinIO, moto, ...), credentials from the usual boto3 chain.
"""

from __future__ import annotations

import io
import json
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from components.config.reasoning_gym_uri import is_reasoning_gym
from components.contracts.task import Task
from components.data.reasoning_gym_tasks import gym_tasks
from components.storage import read_uri

_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")


def read_bytes(uri: str) -> bytes:
    """The raw bytes of a local file or an S3 object; FileNotFoundError names the URI when it does not exist."""
    try:
        return read_uri(uri)
    except FileNotFoundError:
        raise FileNotFoundError(f"problem set not found: {uri}") from None


def _format(name: str) -> str:
    lower = name.lower()
    if lower.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(_PARQUET_SUFFIXES):
        return "parquet"
    raise ValueError(f"{name}: unknown problem set format; expected one of {list(_JSONL_SUFFIXES + _PARQUET_SUFFIXES)}")


def read_rows(uri: str) -> list[dict[str, Any]]:
    """All rows of a JSONL or Parquet problem set (format from the file suffix), as dicts."""
    fmt = _format(uri)
    data = read_bytes(uri)
    if fmt == "parquet":
        try:
            return pq.read_table(io.BytesIO(data)).to_pylist()
        except pa.ArrowException as exc:
            raise ValueError(f"{uri}: not a readable Parquet file: {exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_no = data[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{uri}: line {line_no} is not UTF-8 (byte {data[exc.start]:#04x} at offset {exc.start})"
        ) from None
    rows: list[dict[str, Any]] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{uri}: line {line_no} (row {len(rows)}) is not valid JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{uri}: line {line_no} (row {len(rows)}) is not a JSON object")
        rows.append(row)
    return rows


def _is_empty(value: Any) -> bool:
    # 0 and False are real answers; only absent, blank or empty-container values count as empty.
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, dict, tuple)):
        return len(value) == 0
    return False


def load_tasks(
    uri: str | Path,
    prompt_field: str = "problem",
    answer_field: str | None = "answer",
    id_field: str | None = None,
    limit: int | None = None,
    max_prompt_chars: int | None = None,
) -> list[Task]:
    """Load a problem set as tasks.

    Args:
        uri: local path or `s3://bucket/key`; `.jsonl`/`.ndjson` or `.parquet`/`.pq`; or a
            `reasoning-gym:` URI (the three field names do not apply: its tasks are the dataset's entries).
        prompt_field: column holding the prompt (a non-empty string).
        answer_field: column holding the reference answer (any non-empty value); None for sets without
            answers (e.g. style prompts judged by a model).
        id_field: column holding the task id; None gives `<file stem>-<row>`.
        limit: keep only the first `limit` rows (only those are validated).
        max_prompt_chars: refuse a prompt longer than this (None: no limit); a caller derives it from the
            model's context, since an oversize prompt would otherwise fail only when its episode runs.

    Raises:
        ValueError: the file is empty, not valid JSONL/Parquet or not UTF-8; a row lacks its prompt/answer/id,
            a prompt is not a string or is too long, or two rows share an id; the message names the file, the
            row index and the field.
        FileNotFoundError: the file or object does not exist.
    """
    uri = str(uri)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if is_reasoning_gym(uri):
        return gym_tasks(uri, limit, max_prompt_chars)
    rows = read_rows(uri)
    if not rows:
        raise ValueError(f"{uri}: no rows (an empty problem set)")
    if limit is not None:
        rows = rows[:limit]
    stem = PurePosixPath(uri).stem
    own = {prompt_field, answer_field, id_field} - {None}
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        prompt = row.get(prompt_field)
        if _is_empty(prompt):
            raise ValueError(f"{uri}: row {i}: field {prompt_field!r} is missing or empty")
        if not isinstance(prompt, str):
            raise ValueError(f"{uri}: row {i}: field {prompt_field!r} must be a string, got {type(prompt).__name__}")
        if max_prompt_chars is not None and len(prompt) > max_prompt_chars:
            raise ValueError(
                f"{uri}: row {i}: field {prompt_field!r} has {len(prompt)} characters, more than "
                f"max_prompt_chars={max_prompt_chars}"
            )
        answer = None
        if answer_field is not None:
            answer = row.get(answer_field)
            if _is_empty(answer):
                raise ValueError(f"{uri}: row {i}: field {answer_field!r} is missing or empty")
        if id_field is None:
            task_id = f"{stem}-{i}"
        else:
            if _is_empty(row.get(id_field)):
                raise ValueError(f"{uri}: row {i}: field {id_field!r} is missing or empty")
            task_id = str(row[id_field])
        if task_id in seen:
            raise ValueError(f"{uri}: row {i}: field {id_field!r}: id {task_id!r} repeats row {seen[task_id]}")
        seen[task_id] = i
        metadata = {k: v for k, v in row.items() if k not in own}
        tasks.append(Task(task_id, prompt, answer, metadata))
    return tasks
