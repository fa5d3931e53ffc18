"""`sao` command line.

Each command imports what it runs inside its own branch, after its arguments are parsed: `sao --help`, a refused
flag or a missing file answer at once, without loading torch, transformers, Prefect or MLflow (seconds each).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import typing
from pathlib import Path

from components.config import AlgoName, ConfigError, load_config
from components.storage import HomeStateError, StoreError


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors end like every other CLI error: one `sao: ...` line, exit status 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"sao: {message}\n")


def _int_at_least(minimum: int, maximum: int | None = None):
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


PORT = _int_at_least(0, 65535)
POSITIVE = _int_at_least(1)
NON_NEGATIVE = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    """Every command and flag (the runbooks' commands are checked against it: tests/ops/test_runbooks.py)."""
    parser = _Parser(prog="sao", description="SAO: single-rollout asynchronous RL for LLM agents")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--preset", default="tiny-cpu", help="preset under components/presets (default tiny-cpu)")
        p.add_argument("--home", type=Path, default=None, help="run home (default ./.sao or $SAO_HOME)")
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="config override, e.g. --set sft.steps=200 (repeatable)",
        )

    def flow_command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        common(p)
        return p

    flow_command(
        "pipeline",
        "the whole lifecycle as Prefect flows: distill -> gate -> sft -> "
        "value_pretrain -> train -> evaluate (re-running continues where it stopped)",
    )
    flow_command("run", "the same as `sao pipeline` (`make run`)")
    p_distill = flow_command("distill", "a teacher writes TIR traces, the gate checks them, they become a dataset")
    p_distill.add_argument(
        "--teacher", default=None, help="'programmatic' or the /v1 base URL of a chat endpoint with tool calling"
    )
    p_distill.add_argument("--teacher-model", default=None, help="model name at the teacher endpoint")
    p_gate = sub.add_parser(
        "gate",
        help="check a stored dataset (traces or rollout logs, Parquet, local or s3://) "
        "with its Great Expectations suite",
    )
    common(p_gate)
    p_gate.add_argument("uri", help="Parquet file or s3:// object")
    p_gate.add_argument("--kind", choices=("traces", "rollouts"), default="traces")
    p_sft = flow_command("sft", "supervised fine-tuning on the distilled dataset, then held-out accuracy")
    p_sft.add_argument("--force", action="store_true", help="retrain even if a policy with this recipe exists")
    flow_command(
        "value-pretrain",
        "pretrain the critic on rollouts of the SFT policy (explained variance on "
        "held-out rollouts decides when to stop)",
    )
    p_style = flow_command(
        "style-shift",
        "online learning on the style environment while the preference flips: "
        "the critic-based SAO run against the running-mean baseline",
    )
    p_style.add_argument("--steps-per-phase", type=POSITIVE, default=60, help="policy updates per preference phase")
    p_style.add_argument("--algos", default="sao,sao-running-mean", help="comma-separated algorithms to compare")
    p_compare = sub.add_parser("compare", help="key metrics of MLflow runs side by side, and a plot of their curves")
    p_compare.add_argument("runs", nargs="+", metavar="RUN", help="MLflow run ids or run names")
    p_compare.add_argument("--home", type=Path, default=None, help="run home (its mlflow.db; default ./.sao)")
    p_compare.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the home's)")
    p_compare.add_argument("--out", type=Path, default=None, help="plot file (default <home>/reports/compare.png)")
    p_report = sub.add_parser(
        "report",
        help="MLflow runs side by side in one self-contained HTML file (default: "
        "the newest 3 finished training runs of the experiment)",
    )
    p_report.add_argument("runs", nargs="*", metavar="RUN", help="MLflow run ids or run names")
    p_report.add_argument("--home", type=Path, default=None, help="run home (its mlflow.db; default ./.sao)")
    p_report.add_argument("--experiment", default=None, help="where to look without RUN (default: sao)")
    p_report.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the home's)")
    p_report.add_argument("--out", type=Path, default=None, help="HTML file (default <home>/reports/report.html)")
    p_registry = sub.add_parser(
        "registry",
        help="registered policy and critic versions: aliases (champion, "
        "candidate), checkpoint, score, evaluation set, source",
    )
    p_registry.add_argument("--name", default=None, help="one registered model (default: all)")
    p_registry.add_argument("--home", type=Path, default=None, help="run home (its mlflow.db; default ./.sao)")
    p_registry.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the home's)")
    p_tracking = sub.add_parser("tracking", help="MLflow metrics kept on disk while the server was away")
    tracking_sub = p_tracking.add_subparsers(dest="tracking_command", required=True)
    p_replay = tracking_sub.add_parser(
        "replay", help="deliver what the home's MLflow spools still hold (in order, none twice)"
    )
    p_replay.add_argument("--home", type=Path, default=None, help="run home (default ./.sao or $SAO_HOME)")
    p_replay.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: each spool's own)")
    p_teacher = sub.add_parser("teacher", help="the programmatic solver served as a tool-calling chat endpoint")
    teacher_sub = p_teacher.add_subparsers(dest="teacher_command", required=True)
    p_tserve = teacher_sub.add_parser("serve", help="serve /v1/chat/completions (a stand-in teacher for distill)")
    p_tserve.add_argument("--host", default="127.0.0.1")
    p_tserve.add_argument("--port", type=PORT, default=8100)
    p_tserve.add_argument("--mental-max", type=NON_NEGATIVE, default=0, help="answer a*b < this without a tool call")

    p_eval = sub.add_parser(
        "eval",
        help="evaluate a checkpoint, a model directory or the SFT policy on the episode "
        "path: accuracy (greedy), avg@K and pass@K; registers scored checkpoints",
    )
    common(p_eval)
    p_eval.add_argument(
        "--model",
        type=Path,
        default=None,
        help="HF model directory (default: the newest checkpoint, else the SFT policy)",
    )
    p_eval.add_argument(
        "--checkpoint", type=NON_NEGATIVE, default=None, metavar="STEP", help="evaluate checkpoint STEP"
    )
    p_eval.add_argument("--env", default=None, help="tir_math, coding or style (default: the config's env.name)")
    p_eval.add_argument(
        "--tasks",
        default=None,
        help="problem set or benchmark file, JSONL/Parquet, local or s3:// (default: the environment's held-out set)",
    )
    p_eval.add_argument(
        "--benchmark",
        default=None,
        help="format of --tasks: aime2025, hmmt, beyondaime, imoanswerbench (default: detected)",
    )
    p_eval.add_argument(
        "--samples",
        type=POSITIVE,
        default=1,
        help="K > 1: K sampled episodes per task besides the greedy one, for avg@K and pass@K; 1 "
        "(default): the greedy episode only",
    )

    p_model = sub.add_parser("model", help="model directories")
    model_sub = p_model.add_subparsers(dest="model_command", required=True)
    p_init = model_sub.add_parser("init", help="write a freshly initialised preset model as an HF directory")
    common(p_init)
    p_init.add_argument("--out", type=Path, required=True)
    p_init.add_argument("--seed", type=NON_NEGATIVE, default=0)

    p_rollout = sub.add_parser("rollout", help="run agent episodes with the SFT policy and write them as Parquet")
    common(p_rollout)
    p_rollout.add_argument("--env", default=None, help="tir_math, coding or style (default: the config's env.name)")
    p_rollout.add_argument("--episodes", type=POSITIVE, default=32)
    p_rollout.add_argument("--out", type=Path, required=True, help="output .parquet path")
    p_rollout.add_argument("--model", type=Path, default=None, help="HF model directory (default: the SFT policy)")
    p_rollout.add_argument("--tasks", default=None, help="problem set (JSONL/Parquet, local or s3://)")

    p_train = sub.add_parser("train", help="asynchronous RL from the SFT policy (SAO or a baseline)")
    common(p_train)
    p_train.add_argument("--algo", default=None, help=f"{', '.join(typing.get_args(AlgoName))} (default: the preset's)")
    p_train.add_argument("--max-steps", type=POSITIVE, default=None, help="policy updates (default: the preset's)")
    p_train.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p_train.add_argument(
        "--rollback-to",
        type=NON_NEGATIVE,
        default=None,
        metavar="STEP",
        help="delete the checkpoints after STEP, then resume from STEP (docs/runbooks)",
    )
    p_train.add_argument(
        "--critic",
        type=Path,
        default=None,
        help="pretrained critic directory (from `sao value-pretrain`; sets train.critic_path)",
    )

    p_sweep = sub.add_parser(
        "sweep",
        help="train one config with N RL seeds from one SFT policy; writes a table "
        "of final accuracy, collapses and diagnostics (re-running continues)",
    )
    common(p_sweep)
    p_sweep.add_argument("--seeds", type=POSITIVE, required=True, help="number of RL seeds (train.task_seed values)")
    p_sweep.add_argument("--first-seed", type=NON_NEGATIVE, default=1, help="first train.task_seed (default 1)")
    p_sweep.add_argument(
        "--name", default=None, help="sweep directory under <home>/sweeps (default: a hash of the config)"
    )

    p_engine = sub.add_parser("engine", help="the embedded rollout engine")
    engine_sub = p_engine.add_subparsers(dest="engine_command", required=True)
    p_serve = engine_sub.add_parser("serve", help="serve an HF model directory over the OpenAI-compatible API")
    common(p_serve)
    p_serve.add_argument("--model", type=Path, required=True, help="HF model directory")
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=PORT, default=8000)
    p_serve.add_argument("--max-batch", type=POSITIVE, default=64, help="sequences decoded together at most")
    p_serve.add_argument(
        "--threads",
        type=POSITIVE,
        default=None,
        help="torch CPU threads (default: torch's); leave cores free for clients on the same host",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one `sao` command; returns 0, or raises SystemExit with the status of a refused input.

    Every error ends with one `sao: <message>` line on stderr. A bad input (the project's own errors, which name
    the field or value: `ConfigError` and other `ValueError`s, `OSError`s such as a missing file, the stores'
    and engines' errors; see `_input_errors`) gives exit status 2. Anything else is a bug, not a bad input: it
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
        if isinstance(exc, _input_errors()):
            prefix = "config error: " if isinstance(exc, ConfigError) else ""
            parser.exit(2, f"sao: {prefix}{exc}\n")
        parser.exit(1, f"sao: internal error: {type(exc).__name__}: {exc} (run with SAO_DEBUG=1 for the traceback)\n")


_OWN_ERRORS = (
    ("components.rollout.pool", "EnginesDown"),
    ("components.rollout.client", "EngineError"),
    ("components.data.teacher_client", "TeacherError"),
)
"""Errors of heavy modules that mean a bad input or an unreachable service, not a bug (by module and name)."""


def _input_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean a refused input (exit status 2). `ValueError` covers `ConfigError`,
    `GateFailed` and the contracts' checks; `OSError` a missing, unreadable or unwritable path, a port in use
    and `ConnectionError`. A class whose module was never imported cannot have been raised, so the heavy
    modules of `_OWN_ERRORS` are looked up, not imported."""
    own = tuple(getattr(sys.modules[module], name) for module, name in _OWN_ERRORS if module in sys.modules)
    return (ValueError, OSError, HomeStateError, StoreError, *own)


def _main(args: argparse.Namespace) -> int:
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
        serve_solver(args.host, args.port, args.mental_max)
        return 0
    cfg = load_config(args.preset, args.overrides)

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
        from components.stages.train import is_driver

        if is_driver():  # one rank deletes, before the others are released
            _rollback(cfg, home, args.rollback_to)
    if args.command in FLOW_COMMANDS:
        _run_flow(args, home)
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
    from components.training.checkpoint import checkpoint_store

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


def _rollback(cfg, home: Path, step: int) -> None:
    # loaded after parsing (module docstring)
    from components.training.checkpoint import checkpoint_store

    deleted = checkpoint_store(cfg, home).discard_after(step, print)
    print(f"train: rolled back to step {step} ({len(deleted)} newer checkpoint(s) deleted); resuming")


FLOW_COMMANDS = ("pipeline", "run", "distill", "gate", "sft", "value-pretrain", "train", "eval", "style-shift")
"""Commands that run a Prefect flow (flows/): Prefect's ephemeral API unless PREFECT_API_URL names a server."""


def _run_flow(args: argparse.Namespace, home: Path) -> None:
    params = {"preset": args.preset, "overrides": args.overrides, "home": str(home)}
    _quiet_expected_tracebacks()
    command = args.command
    if command in ("pipeline", "run"):
        # loaded after parsing (module docstring)
        from flows.pipeline import pipeline

        _print_summary(pipeline(**params), home)
    elif command == "distill":
        # loaded after parsing (module docstring)
        from flows.distill import distill

        print(f"dataset: {distill(**params)}")
    elif command == "gate":
        # loaded after parsing (module docstring)
        from components.data.gates import GateFailed
        from flows.gate import gate

        try:
            report = gate(args.uri, args.kind, **params)
        except ValueError as exc:
            if isinstance(exc, GateFailed):  # names the gate, its expectations and rows
                raise
            raise ValueError(f"{args.uri}: {exc}") from exc  # the flow reads the data as bytes, without the name
        print(f"gate: passed, {report['row_count']} rows")
    elif command == "sft":
        # loaded after parsing (module docstring)
        from flows.sft import sft

        result = sft(**params, force=args.force)
        print(f"sft: {result['uri']}, held-out accuracy {result['accuracy']:.1%}")
    elif command == "value-pretrain":
        # loaded after parsing (module docstring)
        from flows.value_pretrain import value_pretrain

        result = value_pretrain(**params)
        print(
            f"critic: {result['uri']}, held-out explained variance {result['ev_cold']:.3f} (cold) -> "
            f"{result['ev_best']:.3f} (pretrained)"
        )
    elif command == "train":
        # loaded after parsing (module docstring)
        from components.stages.train import is_driver, run_rank

        if not is_driver():  # under torchrun the flow is rank 0's; the others serve its steps
            overrides = args.overrides + ([f'train.critic_path="{args.critic}"'] if args.critic else [])
            run_rank(load_config(args.preset, overrides), home, resume=args.resume)
        # loaded after parsing (module docstring)
        from flows.train import train

        train(**params, critic_path=str(args.critic or ""), resume=args.resume)
    elif command == "eval":
        # loaded after parsing (module docstring)
        from flows.evaluate import evaluate

        result = evaluate(
            **params,
            model=str(args.model or ""),
            checkpoint_step=args.checkpoint,
            benchmark=args.benchmark or "",
            tasks=args.tasks or "",
            samples=args.samples,
        )
        k = result["samples"]
        print(
            f"{result['eval_set']}, {result['n']} tasks: accuracy {result['accuracy']:.1%} (greedy), avg@{k} "
            f"{result['avg_at_k']:.1%}, pass@{k} {result['pass_at_k']:.1%}; report {result['report']}"
        )
    elif command == "style-shift":
        # loaded after parsing (module docstring)
        from flows.style_shift import style_shift

        algos = [a.strip() for a in args.algos.split(",") if a.strip()]
        result = style_shift(**params, steps_per_phase=args.steps_per_phase, algos=algos)
        print(f"style-shift: {result['report']}")


class _NoTracebackForInputErrors(logging.Filter):
    """Prefect's console lines keep the message of a flow or task that failed on a bad input but lose its
    traceback: the CLI ends with the error as one `sao:` line. Only the console handler gets this filter;
    Prefect's API log handler (which runs first, on the flow-run logger) and the run's Failed state keep all."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], _input_errors()) and not os.environ.get("SAO_DEBUG"):
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_expected_tracebacks() -> None:
    # loaded after parsing (module docstring)
    import prefect.main  # noqa: F401  (configures Prefect's logging: its console handler sits on the root logger)
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, _NoTracebackForInputErrors) for f in handler.filters
        ):
            handler.addFilter(_NoTracebackForInputErrors())


def _print_summary(summary: dict, home: Path) -> None:
    """The end of `make run`: what came out, and where to look."""

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    def num(x, fmt=".3f"):
        return "-" if x is None else format(x, fmt)

    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home.resolve()}/mlflow.db"
    print(
        "\n".join(
            [
                "",
                "== SAO pipeline ==",
                f"dataset          {summary['dataset']}",
                f"SFT policy       {summary['sft_policy']}  held-out accuracy {pct(summary['sft_accuracy'])}",
                f"critic           {summary['critic'] or '-'}  held-out EV {num(summary['critic_ev_cold'])} cold -> "
                f"{num(summary['critic_ev_pretrained'])} pretrained; RL's critic starts "
                f"{'from it' if summary['critic_warm_start'] else 'cold (value_pretrain.warm_start = false)'}, EV at "
                f"step 1 {num(summary['ev_step1'])}",
                f"SAO              {summary['version']} policy versions, {summary['rollbacks']} rollbacks, "
                f"{num(summary['trajectories_per_s'], '.1f')} trajectories/s (wall clock), trainer idle "
                f"{num(summary['trainer_idle'], '.0%')}",
                f"evaluation       {summary['eval_set']}: accuracy {pct(summary['sft_accuracy'])} after SFT -> "
                f"{pct(summary['accuracy'])} after SAO",
                f"registry         {summary['registered'] or '-'} (champion: version {summary['champion'] or '-'})",
                f"reports          {home / 'reports'}",
                f"MLflow UI        .venv/bin/mlflow ui --backend-store-uri {uri}   # then http://127.0.0.1:5000",
                f"Prefect UI       make prefect-ui   # PREFECT_HOME={os.environ.get('PREFECT_HOME', '~/.prefect')}; "
                "then http://127.0.0.1:4200",
            ]
        )
    )


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
        from components.rollout.server import serve

        _check_port(args.host, args.port)
        serve(args.model, args.host, args.port, args.max_batch, args.threads)


if __name__ == "__main__":
    sys.exit(main())
