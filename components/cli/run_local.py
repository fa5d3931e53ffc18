"""The `sao` commands that run in this process, without Prefect: the memory plan, a fresh model directory,
episodes written as Parquet, and a seed sweep."""

from __future__ import annotations

import argparse
from pathlib import Path

from components.cli.prepare import prepare
from components.config import load_config
from components.models import init_model_dir
from components.stages.rehearse import run_rehearse, summary
from components.stages.rollout import run_rollout
from components.stages.sft import run_sft
from components.stages.sweep import run_sweep
from components.training.plan import report


def plan(args: argparse.Namespace) -> None:
    cfg = load_config(args.preset, args.overrides)
    print(
        report(
            cfg,
            args.gpus,
            args.gpu_memory_gb,
            nodes=args.nodes,
            link_gb_s=args.link_gb_s,
            mean_tokens=args.mean_tokens,
        )
    )


def model_init(args: argparse.Namespace) -> None:
    cfg, _ = prepare(args)
    try:
        print(init_model_dir(cfg.model, args.out, seed=args.seed))
    except OSError as exc:
        raise OSError(f"--out: cannot write a model directory at {args.out}: {exc}") from exc


def rollout(args: argparse.Namespace) -> None:
    """Episodes of the given model, else of the SFT policy (trained first if there is none)."""
    cfg, home = prepare(args)
    run_rollout(cfg, args.model or run_sft(cfg, home), args.episodes, args.out)


def sweep(args: argparse.Namespace) -> None:
    cfg, home = prepare(args)
    run_sweep(cfg, home, args.seeds, args.first_seed, args.name)


def rehearse(args: argparse.Namespace) -> None:
    home = Path(args.home or Path(".sao-rehearse") / args.preset)
    if home.exists() and any(home.iterdir()):
        raise ValueError(f"--home: {home} is not empty; a rehearsal starts from an empty home")
    for line in summary(run_rehearse(args.preset, home.resolve())):
        print(line)
