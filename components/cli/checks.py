"""Input checks made before anything loads: a path flag that cannot be what it names, a port that cannot be bound.
Each refuses with an error that names the flag (exit status 2, one `sao:` line)."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path


def check_paths(args: argparse.Namespace) -> None:
    """Refuse a local path flag that cannot be what it names, before any work (and before a flow's I/O task
    retries a missing file)."""
    model = getattr(args, "model", None)
    if model is not None and not (Path(model) / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"--model: {model} is not a model directory (no tokenizer.json; `sao model init` writes one)"
        )
    critic = getattr(args, "critic", None)
    if critic is not None and not (Path(critic) / "config.json").is_file():
        raise FileNotFoundError(
            f"--critic: {critic} is not a critic directory (no config.json; `sao value-pretrain` writes one)"
        )
    for flag, uri in (("--tasks", getattr(args, "tasks", None)), ("URI", getattr(args, "uri", None))):
        if uri and "://" not in uri and not Path(uri).is_file():
            raise FileNotFoundError(f"{flag}: {uri} is not a file")


def check_port(host: str, port: int) -> None:
    """Bind once before loading anything, so a port in use or a bad host is one `sao:` line, not a server log."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise OSError(f"--host/--port: cannot listen on {host}:{port}: {exc}") from exc
