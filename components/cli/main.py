"""Run one `sao` command: check its input, run it (a flow through `run_flows.py`, or one of the commands that are
not flows), and end any error with one `sao: ...` line (module docstring of components/cli/__init__.py)."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from components.cli.errors import input_errors
from components.cli.parser import build_parser
from components.cli.run_flows import FLOW_COMMANDS, run_flow
from components.config import ConfigError, load_config


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
        return _main(args)
    except Exception as exc:
        if os.environ.get("SAO_DEBUG"):
            raise
        if isinstance(exc, input_errors()):
            prefix = "config error: " if isinstance(exc, ConfigError) else ""
            parser.exit(2, f"sao: {prefix}{exc}\n")
        parser.exit(1, f"sao: internal error: {type(exc).__name__}: {exc} (run with SAO_DEBUG=1 for the traceback)\n")


def _main(args: argparse.Namespace) -> int:
    if args.command == "train" and args.replay is not None:
        return _train_replay(args)
    if args.command == "train":
        args.overrides += [f'train.algo="{args.algo}"'] if args.algo else []
        args.overrides += [f"train.max_steps={args.max_steps}"] if args.max_steps is not None else []
    if args.command in ("eval", "rollout"):
        args.overrides += [f'env.name="{args.env}"'] if args.env else []
    if args.command == "rollout":
        args.overrides += [f'env.tasks="{args.tasks}"'] if args.tasks else []
    if args.command == "distill":
        args.overrides += [f'distill.teacher="{args.teacher}"'] if args.teacher else []
        args.overrides += [f'distill.model="{args.teacher_model}"'] if args.teacher_model else []
    _check_paths(args)
    if args.command == "compare":
        # loaded after parsing (module docstring)
        from components.eval.compare import run_compare

        run_compare(args.runs, args.home, args.tracking_uri, args.out)
        return 0
    if args.command == "report":
        # loaded after parsing (module docstring)
        from components.eval.report import run_report

        run_report(args.runs, args.home, args.experiment, args.out, args.tracking_uri)
        return 0
    if args.command == "registry":
        return _registry(args)
    if args.command == "tracking":
        return _replay(args)
    if args.command == "teacher":
        # loaded after parsing (module docstring)
        from components.data.solver_server import serve_solver

        _check_port(args.host, args.port)
        serve_solver(args.host, args.port, args.mental_max, args.mental_frac)
        return 0
    cfg = load_config(args.preset, args.overrides)
    if args.command == "plan":
        # loaded after parsing (module docstring)
        from components.training.plan import report

        print(report(cfg, args.gpus, args.gpu_memory_gb))
        return 0

    # loaded after parsing (module docstring)
    from transformers.utils import logging as hf_logging

    # loaded after parsing (module docstring)
    from components.stages.home import (
        default_home,  # heavy imports (transformers) only after argument parsing
    )

    hf_logging.disable_progress_bar()  # one concise line per step is our progress display

    home = args.home or default_home()
    if home.exists() and not home.is_dir():
        raise NotADirectoryError(f"--home: {home} is not a directory")
    if args.command == "eval" and args.checkpoint is not None:
        _check_checkpoint(cfg, home, args.checkpoint)
    if args.command == "train" and args.rollback_to is not None:
        args.resume = True
        # loaded after parsing (module docstring)
        from components.stages.ranks import is_driver

        if is_driver():  # one rank deletes, before the others are released
            _rollback(cfg, home, args.rollback_to)
    if args.command in FLOW_COMMANDS:
        run_flow(args, home)
    else:
        _dispatch(args, cfg, home)
    return 0


def _check_paths(args: argparse.Namespace) -> None:
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


def _check_port(host: str, port: int) -> None:
    """Bind once before loading anything, so a port in use or a bad host is one `sao:` line, not a server log."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise OSError(f"--host/--port: cannot listen on {host}:{port}: {exc}") from exc


def _check_checkpoint(cfg, home: Path, step: int) -> None:
    # loaded after parsing (module docstring)
    from components.training.rl.checkpoint import checkpoint_store

    store = checkpoint_store(cfg, home)
    steps = store.steps()
    if step not in steps:
        raise ValueError(
            f"--checkpoint: no complete checkpoint at step {step} in {store.location}; complete: {steps or 'none'}"
        )


def _registry(args: argparse.Namespace) -> int:
    # loaded after parsing (module docstring)
    from mlflow.tracking import MlflowClient

    # loaded after parsing (module docstring)
    from components.config import TrackingConfig
    from components.stages.home import default_home
    from components.tracking import mlflow_uri
    from components.tracking.registry import versions_table

    client = MlflowClient(args.tracking_uri or mlflow_uri(TrackingConfig(), args.home or default_home()))
    rows = versions_table(client, args.name)
    if not rows:
        print("registry: no registered model yet (evaluate registers each scored checkpoint)")
        return 0
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in keys}
    for line in [{k: k for k in keys}, *rows]:
        print("  ".join(line[k].ljust(widths[k]) for k in keys).rstrip())
    return 0


def _replay(args: argparse.Namespace) -> int:
    # loaded after parsing (module docstring)
    from components.stages.home import default_home
    from components.tracking import replay_spool, spool_dir

    spools = spool_dir(args.home or default_home())
    if not spools.is_dir():
        print(f"tracking: nothing to replay ({spools} does not exist)")
        return 0
    # loaded after parsing (module docstring)
    from mlflow.exceptions import MlflowException

    try:
        sent = replay_spool(spools, args.tracking_uri)
    except MlflowException as exc:  # the server is still away: what was not sent stays on disk
        raise ConnectionError(
            f"tracking replay: the MLflow server did not take a record ({exc}); the rest stays "
            f"in {spools}: run it again once the server is back"
        ) from exc
    print(f"tracking: {sent} record(s) delivered from {spools}")
    return 0


def _train_replay(args: argparse.Namespace) -> int:
    if args.resume or args.rollback_to is not None or args.critic is not None or args.algo:
        raise ValueError(
            "--replay: takes the recorded run's config; change it with --set, not --resume, "
            "--rollback-to, --critic or --algo"
        )
    # loaded after parsing (module docstring)
    from components.stages.home import default_home
    from components.stages.train import run_replay

    run_replay(args.replay, args.home or default_home(), args.overrides, stop_at=args.max_steps)
    return 0


def _rollback(cfg, home: Path, step: int) -> None:
    # loaded after parsing (module docstring)
    from components.training.rl.checkpoint import checkpoint_store

    deleted = checkpoint_store(cfg, home).discard_after(step, print)
    print(f"train: rolled back to step {step} ({len(deleted)} newer checkpoint(s) deleted); resuming")


def _dispatch(args: argparse.Namespace, cfg, home: Path) -> None:
    """The commands that are not flows."""
    if args.command == "model":
        # loaded after parsing (module docstring)
        from components.models import init_model_dir

        try:
            print(init_model_dir(cfg.model, args.out, seed=args.seed))
        except OSError as exc:
            raise OSError(f"--out: cannot write a model directory at {args.out}: {exc}") from exc
    elif args.command == "sweep":
        # loaded after parsing (module docstring)
        from components.stages.sweep import run_sweep

        run_sweep(cfg, home, args.seeds, args.first_seed, args.name)
    elif args.command == "rollout":
        # loaded after parsing (module docstring)
        from components.stages.rollout import run_rollout
        from components.stages.sft import run_sft

        model_dir = args.model or run_sft(cfg, home)
        run_rollout(cfg, model_dir, args.episodes, args.out)
    elif args.command == "engine":
        # loaded after parsing (module docstring)
        from components.rollout.access import Access, check_bind
        from components.rollout.server import serve

        access = Access.from_environment(args.publish_root)
        check_bind(args.host, access)
        _check_port(args.host, args.port)
        serve(args.model, args.host, args.port, args.max_batch, args.threads, access)
