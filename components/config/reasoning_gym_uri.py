"""`reasoning-gym:` task sets: `env.tasks` / `env.eval_tasks` naming a reasoning-gym dataset and its options.

    reasoning-gym:<dataset>?size=2000&seed=3&<option>=<value>&...

`<dataset>` is a name `reasoning_gym.create_dataset` knows (`chain_sum`, `basic_arithmetic`, ...); each `<option>`
a field of that dataset's config dataclass, its value parsed as a TOML scalar or array (`max_terms=2`,
`allow_negation=false`, `operators=['+','*']`); a bare word is a string (`format_style=natural`). Three keys are
ours: `size` (tasks in the set; default `DEFAULT_SIZE`), `seed` (the dataset's seed; default `DEFAULT_SEED`) and
`split` (`train` or `eval`: which questions the set may hold, components/data/reasoning_gym_tasks.py).

The split follows the field: `env.tasks` is the training split, `env.eval_tasks` the held-out one (the config
writes `split=eval` into it), and an empty `env.eval_tasks` beside a reasoning-gym `env.tasks` becomes the same
dataset and options, held out (`task_location`). A split that contradicts its field is refused: that is the one
way the two sets could share a question.

Everything is checked when the config is built, so a typo fails before anything runs: an unknown dataset or option
is a `ConfigError` naming the field, the dataset and the closest names; an option's value is checked against the
type of its config field (pydantic) and then by the dataset's own `validate()`. reasoning_gym (about 0.8 s to
import) is imported only when a config uses this form.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
import typing
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pydantic

from components.config.fields import ConfigError, check_location, require

SCHEME = "reasoning-gym:"
SPLITS = ("train", "eval")
DEFAULT_SIZE = {"train": 1000, "eval": 200}
"""Tasks in a set that gives no `size`: 200 held out, as the synthetic arithmetic's `task.eval_size`."""
DEFAULT_SEED = {"train": 0, "eval": 1_000_000}
"""The held-out split's own seed: reasoning-gym draws entry `i` from `Random(seed + i)`, so a seed 10^6 away keeps
the two sets' random streams apart for any size below 10^6 (questions are kept apart by the split itself)."""
OURS = ("size", "seed", "split")
_BARE_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class TaskSet:
    """A parsed `reasoning-gym:` URI."""

    dataset: str
    """The reasoning-gym dataset's registered name."""
    options: dict[str, Any]
    """Its config fields other than seed and size, as validated against their types."""
    size: int
    """Number of tasks in the set."""
    seed: int
    """The dataset's seed: task `index` is `create_dataset(dataset, seed=seed, ...)[index]`."""
    split: str
    """`train` or `eval`: the questions the set may hold."""


def is_reasoning_gym(location: str) -> bool:
    return location.startswith(SCHEME)


def _datasets() -> dict[str, tuple[type, type]]:
    # imported here: about 0.8 s, paid only by a config that names a reasoning-gym set
    import reasoning_gym  # noqa: F401  (registers the datasets)
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _close(name: str, candidates: typing.Iterable[str]) -> str:
    matches = difflib.get_close_matches(name, sorted(candidates), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(map(repr, matches))}?)" if matches else ""


def _value(raw: str, key: str, path: str) -> Any:
    """A query value as TOML (`2`, `false`, `['+','*']`, `'text'`), else a bare word as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        require(
            bool(_BARE_WORD.fullmatch(raw)),
            path,
            f"{key}={raw!r} is not a TOML value or a bare word (quote a string: {key}='...')",
        )
        return raw


def _query(query: str, path: str) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in query.split("&") if query else []:
        key, sep, raw = item.partition("=")
        key = unquote(key).strip()
        require(bool(sep and key), path, f"expected key=value between '&'s, got {item!r}")
        require(key not in params, path, f"{key!r} is given twice")
        params[key] = _value(unquote(raw).strip(), key, path)
    return params


def _int(params: dict[str, Any], key: str, default: int, least: int, path: str) -> int:
    value = params.pop(key, default)
    ok = isinstance(value, int) and not isinstance(value, bool) and least <= value < 2**63
    require(ok, path, f"{key} must be an integer >= {least}, got {value!r}")
    return value


def parse_task_set(location: str, path: str = "env.tasks") -> TaskSet:
    """The `TaskSet` a `reasoning-gym:` URI names, checked against the installed reasoning-gym.

    Raises:
        ConfigError: (`path: ...`) the URI is malformed, the dataset or an option is unknown (closest names
            listed), a value has the wrong type, or the dataset's `validate()` refuses the options.
    """
    require(is_reasoning_gym(location), path, f"expected {SCHEME}<dataset>?key=value&..., got {location!r}")
    name, _, query = location[len(SCHEME) :].partition("?")
    name = unquote(name).strip()
    datasets = _datasets()
    require(bool(name), path, f"{location!r} names no dataset ({SCHEME}<dataset>?...)")
    require(name in datasets, path, f"unknown reasoning-gym dataset {name!r}{_close(name, datasets)}")
    params = _query(query, path)
    split = params.pop("split", "train")
    require(split in SPLITS, path, f"split must be one of {list(SPLITS)}, got {split!r}")
    size = _int(params, "size", DEFAULT_SIZE[split], 1, path)
    seed = _int(params, "seed", DEFAULT_SEED[split], 0, path)
    config_cls = datasets[name][1]
    hints = typing.get_type_hints(config_cls)
    fields = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size"))
    options: dict[str, Any] = {}
    for key, value in params.items():
        require(
            key in fields,
            path,
            f"reasoning-gym {name}: unknown option {key!r}{_close(key, fields + list(OURS))} "
            f"(its options: {fields}; ours: {list(OURS)})",
        )
        try:
            options[key] = pydantic.TypeAdapter(hints[key]).validate_python(value)
        except pydantic.ValidationError as exc:
            problem = "; ".join(e["msg"] for e in exc.errors())
            raise ConfigError(
                f"{path}: reasoning-gym {name}: option {key}={value!r} does not fit {hints[key]}: {problem}"
            ) from None
    try:
        config_cls(**options, seed=seed, size=size).validate()
    except (AssertionError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: reasoning-gym {name}: options {options} refused: {exc}") from None
    return TaskSet(name, options, size, seed, split)


def _keys(location: str) -> list[str]:
    return [unquote(item.partition("=")[0]).strip() for item in filter(None, location.partition("?")[2].split("&"))]


def _with_split(location: str, split: str) -> str:
    base, _, query = location.partition("?")
    return f"{base}?{'&'.join([*filter(None, query.split('&')), f'split={split}'])}"


def held_out_of(train: str) -> str:
    """The held-out set of a training URI: the same dataset and options, its own seed and size."""
    base, _, query = train.partition("?")
    kept = [item for item, key in zip(filter(None, query.split("&")), _keys(train)) if key not in OURS]
    return _with_split(f"{base}?{'&'.join(kept)}" if kept else base, "eval")


def task_location(value: str, path: str, split: str, train: str = "") -> str:
    """`env.tasks` (`split="train"`) or `env.eval_tasks` (`split="eval"`, `train` = `env.tasks`), checked and
    returned as the run reads it: a local path or `s3://bucket/key` as given; a `reasoning-gym:` URI parsed and
    checked, with `split=eval` added to a held-out one; an empty held-out set beside a reasoning-gym training set
    becomes that set held out (`held_out_of`)."""
    if not value and split == "eval" and is_reasoning_gym(train):
        value = held_out_of(train)
    if not is_reasoning_gym(value):
        check_location(value, path, "key")
        return value
    if split == "eval" and "split" not in _keys(value):
        value = _with_split(value, "eval")
    given = parse_task_set(value, path).split
    require(
        given == split,
        path,
        f"split={given} in the {'training' if split == 'train' else 'held-out'} set: {path} draws from the "
        f"{split} split, so that training and held-out questions never meet (leave split out)",
    )
    return value
