"""Run one `sao` command: parse it (parser.py, from the table in commands.py), check its paths, load the function
its entry names and run it; end any error with one `sao: ...` line."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable

from components.cli.checks import check_paths
from components.cli.errors import input_errors
from components.cli.flags import config_overrides
from components.cli.parser import build_parser
from components.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    """Run one `sao` command; returns 0, or raises SystemExit with the status of a refused input.

    Every error ends with one `sao: <message>` line on stderr. A bad input (the project's own errors, which name
    the field or value: `ConfigError` and other `ValueError`s, `OSError`s such as a missing file, the stores'
    and engines' errors; see `components/cli/errors.py`) gives exit status 2. Anything else is a bug, not a bad input: it
    gives `sao: internal error: <type>: <message> (run with SAO_DEBUG=1 for the traceback)` and exit status 1.
    With SAO_DEBUG=1 every exception propagates with its traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run(args)
        return 0
    except Exception as exc:
        if os.environ.get("SAO_DEBUG"):
            raise
        if isinstance(exc, input_errors()):
            prefix = "config error: " if isinstance(exc, ConfigError) else ""
            parser.exit(2, f"sao: {prefix}{exc}\n")
        parser.exit(1, f"sao: internal error: {type(exc).__name__}: {exc} (run with SAO_DEBUG=1 for the traceback)\n")


def run(args: argparse.Namespace) -> None:
    """Run the command `args.entry` (its table entry). A command that takes `--set` reads `args.overrides`: the
    `--set` overrides and those of its flags that set a config field."""
    if hasattr(args, "sets"):
        args.overrides = config_overrides(args.entry.arguments, args)
    check_paths(args)
    load(args.entry.runs)(args)


def load(target: str) -> Callable[[argparse.Namespace], object]:
    """The function "package.module:function", imported now, after parsing (commands.py)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
