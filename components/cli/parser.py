"""The `sao` argument parser, built from the table of commands (commands.py). The runbooks' and the README's
commands are checked against it: tests/ops/test_runbooks.py, tests/test_docs.py."""

from __future__ import annotations

import argparse
import sys
import typing

from components.cli.commands import COMMANDS, GROUPS


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors end like every other CLI error: one `sao: ...` line, exit status 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"sao: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """Every command of `COMMANDS` with its flags; the parsed arguments carry the command's entry as `entry`."""
    parser = _Parser(prog="sao", description="SAO: single-rollout asynchronous RL for LLM agents")
    top = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for command in COMMANDS:
        *group, word = command.name.split()
        sub = top
        if group:
            if group[0] not in groups:
                grouped = top.add_parser(group[0], help=GROUPS[group[0]])
                groups[group[0]] = grouped.add_subparsers(dest=f"{group[0]}_command", required=True)
            sub = groups[group[0]]
        leaf = sub.add_parser(word, help=command.help)
        for f in command.arguments:
            leaf.add_argument(*f.names, **f.options)
        leaf.set_defaults(entry=command)
    return parser
