"""The `sao` commands that are Prefect flows (flows/): Prefect's ephemeral API unless PREFECT_API_URL names a
server. Their console output keeps a refused input to its message (the traceback stays in Prefect's run log), and
`sao pipeline` ends with the summary `make run` shows. Under torchrun the flow is rank 0's: the other ranks follow
its stage (`follow_unless_driver`)."""

from __future__ import annotations

import flows  # noqa: F401  (Prefect's offline settings and startup timeout: read once, when prefect is imported)

# isort: split
import argparse
import logging
import os
from pathlib import Path

import prefect.main  # noqa: F401  (configures Prefect's logging: its console handler sits on the root logger)
from prefect.logging.handlers import PrefectConsoleHandler

import flows.distill
import flows.evaluate
import flows.experiment
import flows.gate
import flows.pipeline
import flows.sft
import flows.style_shift
import flows.train
import flows.value_pretrain
from components.cli.errors import input_errors
from components.cli.prepare import Prepared, prepare
from components.cli.server_guard import guard_temporary_server
from components.config import Config
from components.data.gates import GateFailed
from components.stages.experiment import arm_configs
from components.stages.home import default_home
from components.stages.ranks import follow, is_driver
from components.stages.train import run_replay
from components.training.rl.checkpoint import checkpoint_store


def pipeline(args: argparse.Namespace) -> None:
    home = _start(args).home
    _print_summary(flows.pipeline.pipeline(**_params(args, home)), home)


def distill(args: argparse.Namespace) -> None:
    home = _start(args).home
    print(f"dataset: {flows.distill.distill(**_params(args, home))}")


def gate(args: argparse.Namespace) -> None:
    home = _start(args).home
    try:
        report = flows.gate.gate(args.uri, args.kind, **_params(args, home))
    except ValueError as exc:
        if isinstance(exc, GateFailed):  # names the gate, its expectations and rows
            raise
        raise ValueError(f"{args.uri}: {exc}") from exc  # the flow reads the data as bytes, without the name
    print(f"gate: passed, {report['row_count']} rows")


def sft(args: argparse.Namespace) -> None:
    cfg, home = _start(args)
    follow_unless_driver("sft", cfg, home)
    result = flows.sft.sft(**_params(args, home), force=args.force)
    print(f"sft: {result['uri']}, held-out accuracy {result['accuracy']:.1%}")


def value_pretrain(args: argparse.Namespace) -> None:
    cfg, home = _start(args)
    follow_unless_driver("value-pretrain", cfg, home)
    result = flows.value_pretrain.value_pretrain(**_params(args, home))
    print(
        f"critic: {result['uri']}, held-out explained variance {result['ev_cold']:.3f} (cold) -> "
        f"{result['ev_best']:.3f} (pretrained)"
    )


def train(args: argparse.Namespace) -> None:
    """The train flow (`--critic` reaches it as `train.critic_path`, in the overrides); `--rollback-to STEP`
    deletes the checkpoints after STEP, then resumes; `--replay RUN` trains again on RUN's batches, without a flow."""
    if args.replay is not None:
        _train_replay(args)
        return
    cfg, home = _start(args)
    resume = args.resume or args.rollback_to is not None
    if args.rollback_to is not None and is_driver():  # one rank deletes, before the others are released
        deleted = checkpoint_store(cfg, home).discard_after(args.rollback_to, print)
        print(f"train: rolled back to step {args.rollback_to} ({len(deleted)} newer checkpoint(s) deleted); resuming")
    follow_unless_driver("train", cfg, home, resume)
    flows.train.train(**_params(args, home), resume=resume)


def _train_replay(args: argparse.Namespace) -> None:
    """The recorded run's config with the `--set` overrides only: `--max-steps` stops the replay early."""
    if args.resume or args.rollback_to is not None or args.critic is not None or args.algo:
        raise ValueError(
            "--replay: takes the recorded run's config; change it with --set, not --resume, "
            "--rollback-to, --critic or --algo"
        )
    run_replay(args.replay, args.home or default_home(), args.sets, stop_at=args.max_steps)


def evaluate(args: argparse.Namespace) -> None:
    cfg, home = _start(args)
    if args.checkpoint is not None:
        _check_checkpoint(cfg, home, args.checkpoint)
    result = flows.evaluate.evaluate(
        **_params(args, home),
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


def _check_checkpoint(cfg: Config, home: Path, step: int) -> None:
    store = checkpoint_store(cfg, home)
    steps = store.steps()
    if step not in steps:
        raise ValueError(
            f"--checkpoint: no complete checkpoint at step {step} in {store.location}; complete: {steps or 'none'}"
        )


def style_shift(args: argparse.Namespace) -> None:
    home = _start(args).home
    params = _params(args, home)
    result = flows.style_shift.style_shift(**params, steps_per_phase=args.steps_per_phase, algos=_names(args.algos))
    print(f"style-shift: {result['report']}")


def experiment(args: argparse.Namespace) -> None:
    arm_configs(args.name, args.preset, args.overrides, args.setting, args.quick)  # refused before Prefect starts
    home = _start(args).home
    arms = _names(args.arms) if args.arms else None
    result = flows.experiment.experiment(
        args.name, **_params(args, home), setting=args.setting, quick=args.quick, seeds=args.seeds, arms=arms
    )
    print(Path(result["report"]).read_text().rstrip())


def follow_unless_driver(stage: str, cfg: Config, home: Path, resume: bool = False) -> None:
    """Under torchrun the flow is rank 0's: any other rank follows the stage (components/stages/ranks.py) and ends
    its process there, never reaching the flow."""
    if not is_driver():
        follow(stage, cfg, home, resume=resume)


def _start(args: argparse.Namespace) -> Prepared:
    """The command's config and home (prepare.py); Prefect's console set to keep refused inputs to one line; on the
    driver, Prefect's temporary server (when no PREFECT_API_URL) started with a guard that ends it if this process is
    killed (server_guard.py)."""
    prepared = prepare(args)
    _quiet_expected_tracebacks()
    if is_driver():
        guard_temporary_server()
    return prepared


def _params(args: argparse.Namespace, home: Path) -> dict:
    """The parameters every flow takes: `overrides` as `key=value` strings (the Prefect UI shows them)."""
    return {"preset": args.preset, "overrides": args.overrides, "home": str(home)}


def _names(text: str) -> list[str]:
    """A comma-separated option (`--algos`, `--arms`) as its names."""
    return [name.strip() for name in text.split(",") if name.strip()]


class _NoTracebackForInputErrors(logging.Filter):
    """Prefect's console lines keep the message of a flow or task that failed on a bad input but lose its
    traceback: the CLI ends with the error as one `sao:` line. Only the console handler gets this filter;
    Prefect's API log handler (which runs first, on the flow-run logger) and the run's Failed state keep all."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], input_errors()) and not os.environ.get("SAO_DEBUG"):
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_expected_tracebacks() -> None:
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
