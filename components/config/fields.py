"""The config tree's building blocks: the named choices (each defined once here and imported by the code that
implements it), `ConfigError`, the `section` decorator that makes a frozen, strict pydantic dataclass whose
errors name the dotted field, and the validators the sections share."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError

AlgoName = Literal["sao", "sao-k1", "sao-full-critic", "sao-running-mean", "grpo", "grpo-dis", "ppo"]
"""Algorithms, all trained by one loop (components/training/rl/algorithms.py defines each)."""
AdmissionRule = Literal["capacity", "oldest"]
"""How the trajectory buffer bounds staleness (components/training/rl/buffer.py)."""
RollbackTo = Literal["onset", "near-peak"]
"""Which checkpoint the collapse guard returns to (components/training/rl/stability.py `Collapse.good_step`)."""
LatencyKind = Literal["none", "fixed", "lognormal"]
"""Tool-latency models of `rollout.latency`."""
TokenizerName = Literal["characters", "qwen3"]
"""Tokenizers a model built from config gets (`model.tokenizer`)."""
ChatFormatName = Literal["auto", "markers", "hermes"]
"""`model.chat_format` (components/chat)."""
MalformedCalls = Literal["observe", "end"]
"""What a malformed tool call does (`env.malformed_calls`, components/envs/tool_calls.py)."""
"""Simulated tool latency (components/envs/latency.py)."""
Style = Literal["cute", "chuunibyou", "classical"]
STYLES: tuple[str, ...] = typing.get_args(Style)
"""Target styles of the style environment's preference schedule (components/envs/style.py renders them)."""


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the dotted field path."""


def require(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


def describe(exc: ValidationError, cls: type, prefix: str) -> str:
    """pydantic's errors as `section.field: message`, one per field (a union reports each member: keep one)."""
    lines: dict[str, str] = {}
    for err in exc.errors():
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):  # from __post_init__ or a nested table: it names its path already
            lines.setdefault(str(cause).partition(":")[0], str(cause))
            continue
        loc = err["loc"]  # (field,), (field, index) or (field, union member); a positional argument: (index,)
        name = dataclasses.fields(cls)[loc[0]].name if loc and isinstance(loc[0], int) else "".join(loc[:1])
        path = ".".join(p for p in (prefix, name) if p)
        path += "".join(f"[{p}]" for p in loc[1:] if isinstance(p, int))
        if err["type"] == "unexpected_keyword_argument":
            message = f"unknown field (expected one of {sorted(f.name for f in dataclasses.fields(cls))})"
        else:
            message = f"{err['msg']}, got {err['input']!r}"
        lines.setdefault(path, f"{path}: {message}")
    return "; ".join(lines.values())


def section(prefix: str):
    """Class decorator: a frozen, strict pydantic dataclass whose validation errors are `ConfigError`s
    prefixed with `prefix` (the table's name in `Config`), also when built directly or by `replace`."""

    def wrap(cls: type) -> type:
        cls = pydantic.dataclasses.dataclass(
            frozen=True,
            config=ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, allow_inf_nan=False),
        )(cls)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)
            except ValidationError as exc:
                raise ConfigError(describe(exc, cls, prefix)) from None

        cls.__init__ = __init__
        return cls

    return wrap


T = TypeVar("T")
TupleOf = Annotated[tuple[T, ...], BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)]
"""A tuple field that also takes a list (TOML arrays); strict mode alone accepts only tuples."""

Seed = Annotated[int, Field(ge=0, lt=2**63)]
"""A random seed: torch's generators take 64-bit values."""


def check_location(value: str, path: str, what: str) -> None:
    """Empty, a local path, or `s3://bucket/<what>` (the other URL schemes are not supported)."""
    if "://" not in value:
        return
    scheme, _, rest = value.partition("://")
    bucket, _, key = rest.partition("/")
    require(scheme == "s3", path, f"must be a local path or s3://bucket/{what}, got {value!r}")
    require(bool(bucket), path, f"s3 URI has no bucket: {value!r}")
    require(what == "prefix" or bool(key), path, f"s3 URI has no key: {value!r}")


def is_http_url(value: str) -> bool:
    scheme, sep, rest = value.partition("://")
    return bool(sep) and scheme in ("http", "https") and bool(rest)


def parse_phases(schedule: str, path: str = "env.preference_schedule") -> tuple[tuple[str, int], ...]:
    """`"cute:100,classical:50"` -> (("cute", 100), ("classical", 50)); empty -> (("cute", 1),), cute
    throughout (the schedule repeats after its last phase)."""
    if not schedule.strip():
        return (("cute", 1),)
    phases = []
    for item in schedule.split(","):
        style, sep, steps = (part.strip() for part in item.partition(":"))
        require(
            bool(sep) and steps.isascii() and steps.isdigit() and int(steps) > 0,
            path,
            f"each phase must be style:steps with steps > 0, got {item.strip()!r}",
        )
        require(style in STYLES, path, f"unknown style {style!r} (expected one of {list(STYLES)})")
        phases.append((style, int(steps)))
    return tuple(phases)
