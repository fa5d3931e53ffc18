"""Where every command that runs stages starts: its config (the preset, `--set` and the flags that set a field) and
its run home, both checked before any work."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

from transformers.utils import logging as hf_logging

from components.config import Config, load_config
from components.stages.home import default_home


class Prepared(NamedTuple):
    """A command's config and run home."""

    cfg: Config
    home: Path


def prepare(args: argparse.Namespace) -> Prepared:
    """The command's config, and its home (`--home`, else ./.sao or $SAO_HOME): refused when not a directory."""
    cfg = load_config(args.preset, args.overrides)
    hf_logging.disable_progress_bar()  # one concise line per step is our progress display
    home = args.home or default_home()
    if home.exists() and not home.is_dir():
        raise NotADirectoryError(f"--home: {home} is not a directory")
    return Prepared(cfg, home)
