"""The `sao` commands that are Prefect flows (flows/): Prefect's ephemeral API unless PREFECT_API_URL names a
server. Their console output keeps a refused input to its message (the traceback stays in Prefect's run log), and
`sao pipeline` ends with the summary `make run` shows."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import flows  # noqa: F401  (Prefect's offline settings and startup timeout: read once, when prefect is imported)
from components.cli.errors import input_errors
from components.config import load_config

FLOW_COMMANDS = (
    "pipeline",
    "run",
    "distill",
    "gate",
    "sft",
    "value-pretrain",
    "train",
    "eval",
    "style-shift",
    "experiment",
)
"""Commands that run a Prefect flow (flows/): Prefect's ephemeral API unless PREFECT_API_URL names a server."""


def run_flow(args: argparse.Namespace, home: Path) -> None:
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
        follow_unless_driver(command, args, home)
        # loaded after parsing (module docstring)
        from flows.sft import sft

        result = sft(**params, force=args.force)
        print(f"sft: {result['uri']}, held-out accuracy {result['accuracy']:.1%}")
    elif command == "value-pretrain":
        follow_unless_driver(command, args, home)
        # loaded after parsing (module docstring)
        from flows.value_pretrain import value_pretrain

        result = value_pretrain(**params)
        print(
            f"critic: {result['uri']}, held-out explained variance {result['ev_cold']:.3f} (cold) -> "
            f"{result['ev_best']:.3f} (pretrained)"
        )
    elif command == "train":
        follow_unless_driver(command, args, home)
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

        algos = _names(args.algos)
        result = style_shift(**params, steps_per_phase=args.steps_per_phase, algos=algos)
        print(f"style-shift: {result['report']}")
    elif command == "experiment":
        # loaded after parsing (module docstring)
        from components.stages.experiment import arm_configs
        from flows.experiment import experiment

        # Bad input is refused before Prefect starts.
        arm_configs(args.name, args.preset, args.overrides, args.setting, args.quick)
        arms = _names(args.arms) if args.arms else None
        result = experiment(args.name, **params, setting=args.setting, quick=args.quick, seeds=args.seeds, arms=arms)
        print(Path(result["report"]).read_text().rstrip())


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


def follow_unless_driver(command: str, args: argparse.Namespace, home: Path) -> None:
    """Under torchrun the flow is rank 0's: any other rank follows the stage (components/stages/ranks.py) and ends
    its process there, never reaching the flow."""
    # loaded after parsing (module docstring)
    from components.stages.ranks import follow, is_driver

    if is_driver():
        return
    critic = getattr(args, "critic", None)
    overrides = args.overrides + ([f'train.critic_path="{critic}"'] if critic else [])
    follow(command, load_config(args.preset, overrides), home, resume=getattr(args, "resume", False))
