"""Where every command that runs stages starts: its config (the preset, `--set` and the flags that set a field) and
its run home, both checked before any work."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

from transformers.utils import logging as hf_logging

from components.config import Config, load_config
from components.envs.registry import entrypoint_of, load_factory
from components.stages.home import default_home


class Prepared(NamedTuple):
    """A command's config and run home."""

    cfg: Config
    home: Path


def prepare(args: argparse.Namespace) -> Prepared:
    """The command's config, and its home (`--home`, else ./.sao or $SAO_HOME): refused when not a directory. The
    environment the config names must resolve to a factory (a registered `env.name` or an importable
    `env.entrypoint`) before any work: a misspelt name is one line, not an error from a later stage."""
    cfg = load_config(args.preset, args.overrides)
    load_factory(entrypoint_of(cfg))
    hf_logging.disable_progress_bar()  # one concise line per step is our progress display
    home = args.home or default_home()
    if home.exists() and not home.is_dir():
        raise NotADirectoryError(f"--home: {home} is not a directory")
    return Prepared(cfg, home)
