"""A command's flags as data (`Flag`: argparse's arguments, and the config field a flag sets), the argparse types
that refuse a bad number by name, the options most commands share, and the one function that turns the flags that
set a config field into `--set`-style overrides."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Flag:
    """One argument of a command: its name(s) and argparse's keyword arguments for it (`add_argument(*names,
    **options)`); `sets` names the config field the flag sets (`train.algo`), empty for a flag the command reads."""

    names: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)
    sets: str = ""

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under (its rule: the first name, without dashes)."""
        return self.options.get("dest") or self.names[0].lstrip("-").replace("-", "_")


def flag(*names: str, sets: str = "", **options: Any) -> Flag:
    """`Flag` written like `add_argument`: `flag("--algo", default=None, help=..., sets="train.algo")`."""
    return Flag(names, options, sets)


def _int_in(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum]; argparse names the flag in the message."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _number_where(ok: Callable[[float], bool], bound: str) -> Callable[[str], float]:
    """An argparse type: a number for which `ok` holds (`bound` says which in the message)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


PORT = _int_in(0, 65535)
POSITIVE = _int_in(1)
NON_NEGATIVE = _int_in(0)
POSITIVE_NUMBER = _number_where(lambda v: v > 0, "> 0")
FRACTION = _number_where(lambda v: 0.0 <= v <= 1.0, "in [0, 1]")


def overrides_flag(example: str) -> Flag:
    """`--set KEY=VALUE` (repeatable), with an example in its help."""
    return flag(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"config override, e.g. --set {example} (repeatable)",
    )


PRESET = flag("--preset", default="tiny-cpu", help="preset under components/presets (default tiny-cpu)")
HOME = flag("--home", type=Path, default=None, help="run home (default ./.sao or $SAO_HOME)")
MLFLOW_HOME = flag("--home", type=Path, default=None, help="run home (its mlflow.db; default ./.sao)")
TRACKING_URI = flag("--tracking-uri", default=None, help="MLflow tracking URI (default: the home's)")
COMMON = (PRESET, HOME, overrides_flag("sft.steps=200"))
"""The options of every command that builds a config and works in a run home."""


def config_overrides(flags: Iterable[Flag], args: argparse.Namespace) -> list[str]:
    """The `--set` overrides, then `field=value` for each of `flags` that sets a config field and was given (so
    `--algo` wins over `--set train.algo=...`); values encoded as TOML, as `--set` takes them."""
    given = ((f.sets, getattr(args, f.dest)) for f in flags if f.sets)
    return [*args.sets, *(f"{key}={toml_value(value)}" for key, value in given if value is not None)]


def toml_value(value: object) -> str:
    """`value` as a TOML value: a boolean or a number as itself, anything else (a string, a path) as a TOML basic
    string, with the characters TOML requires escaped (the quote, the backslash and control characters)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + "".join(_escaped(char) for char in str(value)) + '"'


def _escaped(char: str) -> str:
    if char in '"\\':
        return "\\" + char
    if ord(char) < 0x20 or char == "\x7f":
        return f"\\u{ord(char):04x}"
    return char
