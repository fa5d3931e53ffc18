"""`sao` command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from components.config import ConfigError, load_config
from components.storage import HomeStateError, StoreError


def build_parser() -> argparse.ArgumentParser:
    """Every command and flag (the runbooks' commands are checked against it: tests/ops/test_runbooks.py)."""
    parser = argparse.ArgumentParser(prog="sao", description="SAO: single-rollout asynchronous RL for LLM agents")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--preset", default="tiny-cpu", help="preset under components/presets (default tiny-cpu)")
        p.add_argument("--home", type=Path, default=None, help="run home (default ./.sao or $SAO_HOME)")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="config override, e.g. --set sft.steps=200 (repeatable)")

    def flow_command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        common(p)
        return p

    p_pipeline = flow_command("pipeline", "the whole lifecycle as Prefect flows: distill -> gate -> sft -> "
                                          "value_pretrain -> train -> evaluate (re-running continues where it stopped)")
    p_run = flow_command("run", "the same as `sao pipeline` (`make run`)")
    p_distill = flow_command("distill", "a teacher writes TIR traces, the gate checks them, they become a dataset")
    p_distill.add_argument("--teacher", default=None,
                           help="'programmatic' or the /v1 base URL of a chat endpoint with tool calling")
    p_distill.add_argument("--teacher-model", default=None, help="model name at the teacher endpoint")
    p_gate = sub.add_parser("gate", help="check a stored dataset (traces or rollout logs, Parquet, local or s3://) "
                                         "with its Great Expectations suite")
    common(p_gate)
    p_gate.add_argument("uri", help="Parquet file or s3:// object")
    p_gate.add_argument("--kind", choices=("traces", "rollouts"), default="traces")
    p_sft = flow_command("sft", "supervised fine-tuning on the distilled dataset, then held-out accuracy")
    p_sft.add_argument("--force", action="store_true", help="retrain even if a policy with this recipe exists")
    flow_command("value-pretrain", "pretrain the critic on rollouts of the SFT policy (explained variance on "
                                   "held-out rollouts decides when to stop)")
    p_style = flow_command("style-shift", "online learning on the style environment while the preference flips: "
                                          "the critic-based SAO run against the running-mean baseline")
    p_style.add_argument("--steps-per-phase", type=int, default=60, help="policy updates per preference phase")
    p_style.add_argument("--algos", default="sao,sao-running-mean", help="comma-separated algorithms to compare")
    p_compare = sub.add_parser("compare", help="key metrics of MLflow runs side by side, and a plot of their curves")
    p_compare.add_argument("runs", nargs="+", metavar="RUN", help="MLflow run ids or run names")
    p_compare.add_argument("--home", type=Path, default=None, help="run home (its mlflow.db; default ./.sao)")
    p_compare.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the home's)")
    p_compare.add_argument("--out", type=Path, default=None, help="plot file (default <home>/reports/compare.png)")
    p_report = sub.add_parser("report", help="MLflow runs side by side in one self-contained HTML file (default: "
                                             "the newest 3 finished training runs of the experiment)")
    p_report.add_argument("runs", nargs="*", metavar="RUN", help="MLflow run ids or run names")
    p_report.add_argument("--home", type=Path, default=None, help="run home (its mlflow.db; default ./.sao)")
    p_report.add_argument("--experiment", default=None, help="where to look without RUN (default: sao)")
    p_report.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the home's)")
    p_report.add_argument("--out", type=Path, default=None, help="HTML file (default <home>/reports/report.html)")
    p_registry = sub.add_parser("registry", help="registered policy and critic versions: aliases (champion, "
                                                 "candidate), checkpoint, score, evaluation set, source")
    p_registry.add_argument("--name", default=None, help="one registered model (default: all)")
    p_registry.add_argument("--home", type=Path, default=None, help="run home (its mlflow.db; default ./.sao)")
    p_registry.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the home's)")
    p_teacher = sub.add_parser("teacher", help="the programmatic solver served as a tool-calling chat endpoint")
    teacher_sub = p_teacher.add_subparsers(dest="teacher_command", required=True)
    p_tserve = teacher_sub.add_parser("serve", help="serve /v1/chat/completions (a stand-in teacher for distill)")
    p_tserve.add_argument("--host", default="127.0.0.1")
    p_tserve.add_argument("--port", type=int, default=8100)
    p_tserve.add_argument("--mental-max", type=int, default=0, help="answer a*b < this without a tool call")

    p_eval = sub.add_parser("eval", help="evaluate a checkpoint, a model directory or the SFT policy on the episode "
                                         "path: accuracy (greedy), avg@K and pass@K; registers scored checkpoints")
    common(p_eval)
    p_eval.add_argument("--model", type=Path, default=None,
                        help="HF model directory (default: the newest checkpoint, else the SFT policy)")
    p_eval.add_argument("--checkpoint", type=int, default=None, metavar="STEP", help="evaluate checkpoint STEP")
    p_eval.add_argument("--env", default=None, help="tir_math, coding or style (default: the config's env.name)")
    p_eval.add_argument("--tasks", default=None, help="problem set or benchmark file, JSONL/Parquet, local or s3:// "
                                                      "(default: the environment's held-out set)")
    p_eval.add_argument("--benchmark", default=None,
                        help="format of --tasks: aime2025, hmmt, beyondaime, imoanswerbench (default: detected)")
    p_eval.add_argument("--samples", type=int, default=1,
                        help="K > 1: K sampled episodes per task besides the greedy one, for avg@K and pass@K; 1 "
                             "(default): the greedy episode only")

    p_model = sub.add_parser("model", help="model directories")
    model_sub = p_model.add_subparsers(dest="model_command", required=True)
    p_init = model_sub.add_parser("init", help="write a freshly initialised preset model as an HF directory")
    common(p_init)
    p_init.add_argument("--out", type=Path, required=True)
    p_init.add_argument("--seed", type=int, default=0)

    p_rollout = sub.add_parser("rollout", help="run agent episodes with the SFT policy and write them as Parquet")
    common(p_rollout)
    p_rollout.add_argument("--env", default=None, help="tir_math, coding or style (default: the config's env.name)")
    p_rollout.add_argument("--episodes", type=int, default=32)
    p_rollout.add_argument("--out", type=Path, required=True, help="output .parquet path")
    p_rollout.add_argument("--model", type=Path, default=None, help="HF model directory (default: the SFT policy)")
    p_rollout.add_argument("--tasks", default=None, help="problem set (JSONL/Parquet, local or s3://)")

    p_train = sub.add_parser("train", help="asynchronous RL from the SFT policy (SAO or a baseline)")
    common(p_train)
    p_train.add_argument("--algo", default=None, help="sao, sao-k1, sao-full-critic, sao-running-mean, grpo, "
                                                      "grpo-dis, ppo (default: the preset's)")
    p_train.add_argument("--max-steps", type=int, default=None, help="policy updates (default: the preset's)")
    p_train.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p_train.add_argument("--rollback-to", type=int, default=None, metavar="STEP",
                         help="delete the checkpoints after STEP, then resume from STEP (docs/runbooks)")
    p_train.add_argument("--critic", type=Path, default=None,
                         help="pretrained critic directory (from `sao value-pretrain`; sets train.critic_path)")

    p_sweep = sub.add_parser("sweep", help="train one config with N RL seeds from one SFT policy; writes a table "
                                           "of final accuracy, collapses and diagnostics (re-running continues)")
    common(p_sweep)
    p_sweep.add_argument("--seeds", type=int, required=True, help="number of RL seeds (train.task_seed values)")
    p_sweep.add_argument("--first-seed", type=int, default=1, help="first train.task_seed (default 1)")
    p_sweep.add_argument("--name", default=None,
                         help="sweep directory under <home>/sweeps (default: a hash of the config)")

    p_engine = sub.add_parser("engine", help="the embedded rollout engine")
    engine_sub = p_engine.add_subparsers(dest="engine_command", required=True)
    p_serve = engine_sub.add_parser("serve", help="serve an HF model directory over the OpenAI-compatible API")
    common(p_serve)
    p_serve.add_argument("--model", type=Path, required=True, help="HF model directory")
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=8000)
    p_serve.add_argument("--max-batch", type=int, default=64, help="sequences decoded together at most")
    p_serve.add_argument("--threads", type=int, default=None,
                         help="torch CPU threads (default: torch's); leave cores free for clients on the same host")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
    if args.command == "compare":
        from components.pipeline.compare import run_compare

        try:
            run_compare(args.runs, args.home, args.tracking_uri, args.out)
        except ValueError as exc:
            parser.exit(2, f"sao: {exc}\n")
        return 0
    if args.command == "report":
        from components.eval.report import run_report

        try:
            run_report(args.runs, args.home, args.experiment, args.out, args.tracking_uri)
        except ValueError as exc:
            parser.exit(2, f"sao: {exc}\n")
        return 0
    if args.command == "registry":
        return _registry(args, parser)
    if args.command == "teacher":
        from components.data.solver_server import serve_solver

        serve_solver(args.host, args.port, args.mental_max)
        return 0
    try:
        cfg = load_config(args.preset, args.overrides)
    except ConfigError as exc:
        parser.exit(2, f"sao: config error: {exc}\n")

    from transformers.utils import logging as hf_logging

    from components import jobs  # heavy imports (transformers) only after argument parsing

    hf_logging.disable_progress_bar()  # one concise line per step is our progress display

    home = args.home or jobs.default_home()
    from components.data.gates import GateFailed
    from components.data.teacher_client import TeacherError
    from components.rollout.pool import EnginesDown

    model = getattr(args, "model", None)
    if model is not None and not (Path(model) / "tokenizer.json").is_file():
        parser.exit(2, f"sao: --model: {model} is not a model directory (no tokenizer.json; `sao model init` "
                       f"writes one)\n")

    try:
        if args.command == "train" and args.rollback_to is not None:
            args.resume = True
            if int(os.environ.get("RANK", "0")) == 0:  # one rank deletes, before the others are released
                _rollback(cfg, home, args.rollback_to, parser)
        if args.command in FLOW_COMMANDS:
            _run_flow(args, home, parser)
        else:
            _dispatch(args, cfg, home, parser)
    except (HomeStateError, StoreError, GateFailed, TeacherError, EnginesDown, ConnectionError) as exc:
        parser.exit(2, f"sao: {exc}\n")
    return 0


def _registry(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from mlflow.tracking import MlflowClient

    from components.config import TrackingConfig
    from components.jobs import default_home
    from components.pipeline.model_registry import versions_table
    from components.tracking import mlflow_uri

    client = MlflowClient(args.tracking_uri or mlflow_uri(TrackingConfig(), args.home or default_home()))
    try:
        rows = versions_table(client, args.name)
    except ValueError as exc:
        parser.exit(2, f"sao: {exc}\n")
    if not rows:
        print("registry: no registered model yet (evaluate registers each scored checkpoint)")
        return 0
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in keys}
    for line in [{k: k for k in keys}, *rows]:
        print("  ".join(line[k].ljust(widths[k]) for k in keys).rstrip())
    return 0


def _rollback(cfg, home: Path, step: int, parser: argparse.ArgumentParser) -> None:
    from components.training.trainer import checkpoint_store

    try:
        deleted = checkpoint_store(cfg, home).discard_after(step, print)
    except ValueError as exc:
        parser.exit(2, f"sao: {exc}\n")
    print(f"train: rolled back to step {step} ({len(deleted)} newer checkpoint(s) deleted); resuming")


FLOW_COMMANDS = ("pipeline", "run", "distill", "gate", "sft", "value-pretrain", "train", "eval", "style-shift")
"""Commands that run a Prefect flow (flows/): Prefect's ephemeral API unless PREFECT_API_URL names a server."""


def _run_flow(args: argparse.Namespace, home: Path, parser: argparse.ArgumentParser) -> None:
    params = {"preset": args.preset, "overrides": args.overrides, "home": str(home)}
    command = args.command
    if command in ("pipeline", "run"):
        from flows.pipeline import pipeline

        _print_summary(pipeline(**params), home)
    elif command == "distill":
        from flows.distill import distill

        print(f"dataset: {distill(**params)}")
    elif command == "gate":
        from flows.gate import gate

        report = gate(args.uri, args.kind, **params)
        print(f"gate: passed, {report['row_count']} rows")
    elif command == "sft":
        from flows.sft import sft

        result = sft(**params, force=args.force)
        print(f"sft: {result['uri']}, held-out accuracy {result['accuracy']:.1%}")
    elif command == "value-pretrain":
        from flows.value_pretrain import value_pretrain

        result = value_pretrain(**params)
        print(f"critic: {result['uri']}, held-out explained variance {result['ev_cold']:.3f} (cold) -> "
              f"{result['ev_best']:.3f} (pretrained)")
    elif command == "train":
        if int(os.environ.get("RANK", "0")) != 0:  # under torchrun the flow is rank 0's; the others serve its steps
            from components import jobs
            from components.config import load_config

            overrides = args.overrides + ([f'train.critic_path="{args.critic}"'] if args.critic else [])
            jobs.run_train(load_config(args.preset, overrides), home, resume=args.resume)
            return
        from flows.train import train

        train(**params, critic_path=str(args.critic or ""), resume=args.resume)
    elif command == "eval":
        from flows.evaluate import evaluate

        if args.samples < 1:
            parser.exit(2, f"sao: --samples must be >= 1, got {args.samples}\n")
        result = evaluate(**params, model=str(args.model or ""), checkpoint_step=args.checkpoint,
                          benchmark=args.benchmark or "", tasks=args.tasks or "", samples=args.samples)
        k = result["samples"]
        print(f"{result['eval_set']}, {result['n']} tasks: accuracy {result['accuracy']:.1%} (greedy), avg@{k} "
              f"{result['avg_at_k']:.1%}, pass@{k} {result['pass_at_k']:.1%}; report {result['report']}")
    elif command == "style-shift":
        from flows.style_shift import style_shift

        algos = [a.strip() for a in args.algos.split(",") if a.strip()]
        result = style_shift(**params, steps_per_phase=args.steps_per_phase, algos=algos)
        print(f"style-shift: {result['report']}")


def _print_summary(summary: dict, home: Path) -> None:
    """The end of `make run`: what came out, and where to look."""
    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    def num(x, fmt=".3f"):
        return "-" if x is None else format(x, fmt)

    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home.resolve()}/mlflow.db"
    print("\n".join([
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
    ]))


def _dispatch(args: argparse.Namespace, cfg, home: Path, parser: argparse.ArgumentParser) -> None:
    """The commands that are not flows."""
    from components import jobs

    if args.command == "model":
        from components.models import init_model_dir

        print(init_model_dir(cfg.model, args.out, seed=args.seed))
    elif args.command == "sweep":
        from components.sweep import run_sweep

        if args.seeds < 1:
            parser.exit(2, f"sao: --seeds must be >= 1, got {args.seeds}\n")
        run_sweep(cfg, home, args.seeds, args.first_seed, args.name)
    elif args.command == "rollout":
        from components.agent.rollout_job import run_rollout

        if args.episodes < 1:
            parser.exit(2, f"sao: --episodes must be >= 1, got {args.episodes}\n")
        model_dir = args.model or jobs.run_sft(cfg, home)
        run_rollout(cfg, model_dir, args.episodes, args.out)
    elif args.command == "engine":
        from components.rollout.server import serve

        serve(args.model, args.host, args.port, args.max_batch, args.threads)


if __name__ == "__main__":
    sys.exit(main())
