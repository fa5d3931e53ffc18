"""Every `sao` command and flag (the runbooks' and the README's commands are checked against it:
tests/ops/test_runbooks.py, tests/test_docs.py)."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from components.config import AlgoName


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


def _number_where(ok, bound: str):
    """An argparse type: a number for which `ok` holds (`bound` says which in the message)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


PORT = _int_at_least(0, 65535)
POSITIVE = _int_at_least(1)
NON_NEGATIVE = _int_at_least(0)
POSITIVE_NUMBER = _number_where(lambda v: v > 0, "> 0")
FRACTION = _number_where(lambda v: 0.0 <= v <= 1.0, "in [0, 1]")


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
    p_experiment = flow_command(
        "experiment",
        "one of the paper's claims measured as arms x seeds from one SFT policy: a table per arm (mean, min-max, "
        "95%% interval, collapses) and curves (re-running continues; docs/results.md)",
    )
    p_experiment.add_argument("name", metavar="NAME", help="stability, ablation, value-pretraining or style-shift")
    p_experiment.add_argument(
        "--setting",
        default="default",
        help="default (the preset's task) or hard (two-call problems, wider mental zone)",
    )
    p_experiment.add_argument("--quick", action="store_true", help="CI-sized: 2 seeds of a few small steps per arm")
    p_experiment.add_argument("--seeds", type=POSITIVE, default=None, help="seeds per arm (default: the experiment's)")
    p_experiment.add_argument("--arms", default=None, help="comma-separated arms to run (default: all)")
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
    p_tserve.add_argument(
        "--mental-frac", type=FRACTION, default=1.0, help="the share of those answered without a tool call (default 1)"
    )

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

    p_plan = sub.add_parser(
        "plan",
        help="per-GPU memory of the preset's training (weights, gradients, optimizer, activations) for each ZeRO "
        "stage and critic placement, and the cheapest configuration that fits (docs/gpu.md)",
    )
    p_plan.add_argument("--preset", default="tiny-cpu", help="preset under components/presets (default tiny-cpu)")
    p_plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. --set rollout.max_total_tokens=32768 (repeatable)",
    )
    p_plan.add_argument("--gpus", type=POSITIVE, required=True, help="GPUs that train (the torchrun ranks)")
    p_plan.add_argument(
        "--gpu-memory-gb",
        type=POSITIVE_NUMBER,
        default=141.0,
        help="memory of one GPU for training, in GB of 1e9 bytes (default 141: an H200)",
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
        "--replay",
        type=Path,
        default=None,
        metavar="RUN",
        help="train again on the batches RUN recorded (its home, a sweep seed's home or its batches/ folder), "
        "without the engine: bit-identical to the run, or a study of the same batches with --set overrides; "
        "--max-steps stops it early (docs/stability.md)",
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
    p_serve.add_argument(
        "--publish-root",
        type=Path,
        default=None,
        help="load posted weights only from inside this directory (required, with $SAO_WEIGHTS_TOKEN, beyond loopback)",
    )
    return parser
