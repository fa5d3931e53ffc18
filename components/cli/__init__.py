"""`sao` command line: `parser.py` defines every command and flag, `main.py` runs them (input checks, the commands
that are not flows, errors as one `sao:` line), `run_flows.py` runs the commands that are Prefect flows.

Each command imports what it runs inside its own branch, after its arguments are parsed: `sao --help`, a refused
flag or a missing file answer at once, without loading torch, transformers, Prefect or MLflow (seconds each).
"""

from components.cli.main import main
from components.cli.parser import build_parser

__all__ = ["build_parser", "main"]
