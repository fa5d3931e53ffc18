"""Tasks from a reasoning-gym dataset (`reasoning-gym:<dataset>?...`, components/config/reasoning_gym_uri.py),
and their rewards from the dataset's own `score_answer`.

Task `i` of a set is an entry of `reasoning_gym.create_dataset(dataset, seed=seed, **options)`: its question is the
prompt, its answer the reference, and the whole entry rides in `Task.metadata["reasoning_gym"]` with the dataset,
options and seed, which is all `gym_score` needs. The id is `<dataset>-<seed>-<index>`, the entry's index.

Train and held-out sets never share a question. Each question belongs to one split by a hash of its text
(`split_of`: `HELD_OUT_SHARE` of all questions are held out); a `split=train` set keeps the dataset's entries in
index order whose question is a training one, a `split=eval` set those held out, until it has `size`. This holds
whatever the two sets' seeds and sizes: seeds alone would not do it (reasoning-gym draws entry `i` from
`Random(seed + i)`, so seeds 0 and 1 share all but one entry, and a small question space repeats its questions
under any seed). The synthetic arithmetic set does the same with a list of held-out questions
(components/data/tasks.py); a hash needs no list, so a set is made without knowing the other.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from components.config.reasoning_gym_uri import TaskSet, parse_task_set
from components.contracts.task import Task

HELD_OUT_SHARE = 0.1
"""The share of a dataset's questions that only held-out sets draw."""
SCAN_SLACK = 3
"""A set looks at up to this many times the entries its split's share should need before it gives up."""
METADATA_KEY = "reasoning_gym"
"""Where a task keeps its entry: `{"dataset", "options", "seed", "index", "entry"}`."""


def split_of(question: str) -> str:
    """`eval` for the questions whose hash falls in the first `HELD_OUT_SHARE` of [0, 1), else `train`."""
    point = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64
    return "eval" if point < HELD_OUT_SHARE else "train"


def _dataset(spec: TaskSet, size: int):
    import reasoning_gym  # about 0.8 s: only runs that name a reasoning-gym set pay it

    return reasoning_gym.create_dataset(spec.dataset, seed=spec.seed, size=size, **spec.options)


def gym_tasks(location: str, limit: int | None = None, max_prompt_chars: int | None = None) -> list[Task]:
    """The tasks of a `reasoning-gym:` URI (`load_tasks` sends that form here).

    Args:
        location: `reasoning-gym:<dataset>?size=...&seed=...&split=...&<option>=<value>`.
        limit: keep only the first `limit` tasks.
        max_prompt_chars: refuse a question longer than this (None: no limit).

    Raises:
        ConfigError: the URI does not parse or names an unknown dataset or option.
        ValueError: the split holds too few of the dataset's questions to fill `size` (options that leave only a
            handful of distinct questions), or a question is too long; the message names the location.
    """
    spec = parse_task_set(location, location)
    size = spec.size if limit is None else min(spec.size, limit)
    share = HELD_OUT_SHARE if spec.split == "eval" else 1 - HELD_OUT_SHARE
    scan = math.ceil(size / share * SCAN_SLACK) + 100
    dataset = _dataset(spec, scan)
    tasks: list[Task] = []
    for index in range(scan):
        if len(tasks) == size:
            break
        entry = dataset[index]
        question = entry["question"]
        if split_of(question) != spec.split:
            continue
        if max_prompt_chars is not None and len(question) > max_prompt_chars:
            raise ValueError(
                f"{location}: entry {index} has a question of {len(question)} characters, more than "
                f"max_prompt_chars={max_prompt_chars}"
            )
        record = {"dataset": spec.dataset, "options": spec.options, "seed": spec.seed, "index": index, "entry": entry}
        tasks.append(Task(f"{spec.dataset}-{spec.seed}-{index}", question, entry["answer"], {METADATA_KEY: record}))
    if len(tasks) < size:
        raise ValueError(
            f"{location}: only {len(tasks)} of the first {scan} entries are {spec.split} questions, fewer than "
            f"size={size}: these options leave too few distinct questions to split (widen them)"
        )
    return tasks


def is_gym_task(task: Task) -> bool:
    return METADATA_KEY in task.metadata


_SCORERS: dict[tuple[str, str, int], Any] = {}
"""One dataset object per (dataset, options, seed) scored in this process: `score_answer` may read its config."""


def _scorer(record: dict[str, Any]):
    key = (record["dataset"], json.dumps(record["options"], sort_keys=True, default=str), record["seed"])
    if key not in _SCORERS:
        _SCORERS[key] = _dataset(TaskSet(record["dataset"], record["options"], 1, record["seed"], "train"), 1)
    return _SCORERS[key]


def gym_score(task: Task, answer: str | None) -> float:
    """The reward of `answer` (the model's final answer, e.g. the content of its last `\\boxed{}`; None when it
    gave none) on a reasoning-gym task: the dataset's `score_answer(answer, entry)`, a number in [0, 1] (the base
    class gives partial credit `len(reference) / len(answer)` to an answer containing the reference).

    Raises:
        ValueError: the dataset returned something other than a number in [0, 1] (names the dataset and task).
    """
    record: dict[str, Any] = task.metadata[METADATA_KEY]
    reward = _scorer(record).score_answer(answer, record["entry"])
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not 0.0 <= reward <= 1.0:
        raise ValueError(
            f"reasoning-gym {record['dataset']}: score_answer returned {reward!r} for task {task.task_id}, not a "
            "number in [0, 1]"
        )
    return float(reward)
