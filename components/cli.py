"""`sao` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from components.config import ConfigError, load_config
from components.storage import HomeStateError, StoreError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sao", description="SAO: single-rollout asynchronous RL for LLM agents")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--preset", default="tiny-cpu", help="preset under components/presets (default tiny-cpu)")
        p.add_argument("--home", type=Path, default=None, help="run home (default ./.sao or $SAO_HOME)")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="config override, e.g. --set sft.steps=200 (repeatable)")

    p_run = sub.add_parser("run", help="the embedded pipeline: teacher traces -> SFT -> eval -> SAO training -> "
                                       "eval (re-running continues where it stopped)")
    common(p_run)
    p_run.add_argument("--force", action="store_true",
                       help="retrain SFT and RL from scratch (removes this preset's training checkpoints)")

    p_eval = sub.add_parser("eval", help="held-out evaluation of a model directory on the episode path: accuracy "
                                         "(greedy), avg@K and pass@K")
    common(p_eval)
    p_eval.add_argument("--model", type=Path, default=None, help="HF model directory (default: the SFT policy)")
    p_eval.add_argument("--env", default=None, help="tir_math, coding or style (default: the config's env.name)")
    p_eval.add_argument("--tasks", default=None, help="held-out problem set, JSONL/Parquet, local or s3:// "
                                                      "(default: the config's env.eval_tasks, else built-in)")
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

    args = parser.parse_args(argv)
    if args.command == "train":
        args.overrides += [f'train.algo="{args.algo}"'] if args.algo else []
        args.overrides += [f"train.max_steps={args.max_steps}"] if args.max_steps is not None else []
    if args.command in ("eval", "rollout"):
        args.overrides += [f'env.name="{args.env}"'] if args.env else []
        tasks_field = "eval_tasks" if args.command == "eval" else "tasks"
        args.overrides += [f'env.{tasks_field}="{args.tasks}"'] if args.tasks else []
    try:
        cfg = load_config(args.preset, args.overrides)
    except ConfigError as exc:
        parser.exit(2, f"sao: config error: {exc}\n")

    from transformers.utils import logging as hf_logging

    from components import jobs  # heavy imports (transformers) only after argument parsing

    hf_logging.disable_progress_bar()  # one concise line per step is our progress display

    home = args.home or jobs.default_home()
    try:
        _dispatch(args, cfg, home, parser)
    except (HomeStateError, StoreError) as exc:
        parser.exit(2, f"sao: {exc}\n")
    return 0


def _dispatch(args: argparse.Namespace, cfg, home: Path, parser: argparse.ArgumentParser) -> None:
    from components import jobs

    if args.command == "run":
        jobs.run_pipeline(cfg, home, force=args.force)
    elif args.command == "eval":
        if args.samples < 1:
            parser.exit(2, f"sao: --samples must be >= 1, got {args.samples}\n")
        report = jobs.run_eval(cfg, args.model or jobs.run_sft(cfg, home), home, "eval", args.samples)
        k = report.samples
        print(f"{report.env} held-out, {report.n} tasks: accuracy {report.accuracy:.1%} (greedy), "
              f"avg@{k} {report.avg_at_k:.1%}, pass@{k} {report.pass_at_k:.1%}; report {home / 'reports'}/eval.json")
    elif args.command == "model":
        from components.models import init_model_dir

        print(init_model_dir(cfg.model, args.out, seed=args.seed))
    elif args.command == "train":
        jobs.run_train(cfg, home, resume=args.resume)
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
