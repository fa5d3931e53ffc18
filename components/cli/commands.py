"""Every `sao` command, once: its name, help, flags, whether it takes the common options (`--preset`, `--home`,
`--set`) and the function it runs. The parser (parser.py) is built from this table and `main` (main.py) runs the
entry a command line chose; a new command is one entry here and its function.

`runs` names the function as "package.module:function", imported only once the arguments are parsed: `sao --help`,
a refused flag or a missing file answer at once, without loading torch, transformers, Prefect or MLflow. The
functions sit in modules grouped by what they load: run_flows.py (the Prefect flows), run_mlflow.py (MLflow's
store), run_servers.py (the served endpoints) and run_local.py (the rest, in this process).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path

from components.cli.flags import (
    COMMON,
    FRACTION,
    HOME,
    MLFLOW_HOME,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    POSITIVE_NUMBER,
    PRESET,
    TRACKING_URI,
    Flag,
    flag,
    overrides_flag,
)
from components.config import AlgoName


@dataclass(frozen=True)
class Command:
    """One `sao` command. `name` is one word, or a group and a word (`teacher serve`: see `GROUPS`); `runs` is
    the function that runs it ("package.module:function", called with the parsed arguments); `common` adds the
    options of `COMMON` before `flags`."""

    name: str
    help: str
    runs: str
    flags: tuple[Flag, ...] = ()
    common: bool = True

    @property
    def arguments(self) -> tuple[Flag, ...]:
        """All of its flags, the common options first."""
        return (*COMMON, *self.flags) if self.common else self.flags


GROUPS = {
    "tracking": "MLflow metrics kept on disk while the server was away",
    "teacher": "the programmatic solver served as a tool-calling chat endpoint",
    "model": "model directories",
    "engine": "the embedded rollout engine",
}
"""The words that group commands (`sao teacher serve`), with their help."""

_FLOWS = "components.cli.run_flows"
_MLFLOW = "components.cli.run_mlflow"
_SERVERS = "components.cli.run_servers"
_LOCAL = "components.cli.run_local"

_MODEL = "HF model directory"
_ENV = "a registered environment: tir_math, coding, style or a package's (default: the config's env.name)"
_HOST = flag("--host", default="127.0.0.1")
_RUNS_HELP = "MLflow run ids or run names"

COMMANDS = (
    Command(
        "pipeline",
        "the whole lifecycle as Prefect flows: distill -> gate -> sft -> value_pretrain -> train -> evaluate "
        "(re-running continues where it stopped)",
        f"{_FLOWS}:pipeline",
    ),
    Command("run", "the same as `sao pipeline` (`make run`)", f"{_FLOWS}:pipeline"),
    Command(
        "distill",
        "a teacher writes TIR traces, the gate checks them, they become a dataset",
        f"{_FLOWS}:distill",
        (
            flag(
                "--teacher",
                default=None,
                help="'programmatic' or the /v1 base URL of a chat endpoint with tool calling",
                sets="distill.teacher",
            ),
            flag("--teacher-model", default=None, help="model name at the teacher endpoint", sets="distill.model"),
        ),
    ),
    Command(
        "gate",
        "check a stored dataset (traces or rollout logs, Parquet, local or s3://) with its Great Expectations suite",
        f"{_FLOWS}:gate",
        (
            flag("uri", help="Parquet file or s3:// object"),
            flag("--kind", choices=("traces", "rollouts"), default="traces"),
        ),
    ),
    Command(
        "sft",
        "supervised fine-tuning on the distilled dataset, then held-out accuracy",
        f"{_FLOWS}:sft",
        (flag("--force", action="store_true", help="retrain even if a policy with this recipe exists"),),
    ),
    Command(
        "value-pretrain",
        "pretrain the critic on rollouts of the SFT policy (explained variance on held-out rollouts decides when "
        "to stop)",
        f"{_FLOWS}:value_pretrain",
    ),
    Command(
        "style-shift",
        "online learning on the style environment while the preference flips: the critic-based SAO run against "
        "the running-mean baseline",
        f"{_FLOWS}:style_shift",
        (
            flag("--steps-per-phase", type=POSITIVE, default=60, help="policy updates per preference phase"),
            flag("--algos", default="sao,sao-running-mean", help="comma-separated algorithms to compare"),
        ),
    ),
    Command(
        "experiment",
        "one of the paper's claims measured as arms x seeds from one SFT policy: a table per arm (mean, min-max, "
        "95%% interval, collapses) and curves (re-running continues; docs/results.md)",
        f"{_FLOWS}:experiment",
        (
            flag("name", metavar="NAME", help="stability, ablation, value-pretraining or style-shift"),
            flag(
                "--setting",
                default="default",
                help="default (the preset's task), hard (two-call problems, wider mental zone) or paper (hard, a bf16 "
                "engine, heavy-tailed tool latency, staleness by design, 400 steps)",
            ),
            flag("--quick", action="store_true", help="CI-sized: 2 seeds of a few small steps per arm"),
            flag("--seeds", type=POSITIVE, default=None, help="seeds per arm (default: the experiment's)"),
            flag("--arms", default=None, help="comma-separated arms to run (default: all)"),
        ),
    ),
    Command(
        "compare",
        "key metrics of MLflow runs side by side, and a plot of their curves",
        f"{_MLFLOW}:compare",
        (
            flag("runs", nargs="+", metavar="RUN", help=_RUNS_HELP),
            MLFLOW_HOME,
            TRACKING_URI,
            flag("--out", type=Path, default=None, help="plot file (default <home>/reports/compare.png)"),
        ),
        common=False,
    ),
    Command(
        "report",
        "MLflow runs side by side in one self-contained HTML file (default: the newest 3 finished training runs "
        "of the experiment)",
        f"{_MLFLOW}:report",
        (
            flag("runs", nargs="*", metavar="RUN", help=_RUNS_HELP),
            MLFLOW_HOME,
            flag("--experiment", default=None, help="where to look without RUN (default: sao)"),
            TRACKING_URI,
            flag("--out", type=Path, default=None, help="HTML file (default <home>/reports/report.html)"),
        ),
        common=False,
    ),
    Command(
        "registry",
        "registered policy and critic versions: aliases (champion, candidate), checkpoint, score, evaluation set, "
        "source",
        f"{_MLFLOW}:registry",
        (flag("--name", default=None, help="one registered model (default: all)"), MLFLOW_HOME, TRACKING_URI),
        common=False,
    ),
    Command(
        "tracking replay",
        "deliver what the home's MLflow spools still hold (in order, none twice)",
        f"{_MLFLOW}:tracking_replay",
        (
            HOME,
            flag("--tracking-uri", default=None, help="MLflow tracking URI (default: each spool's own)"),
        ),
        common=False,
    ),
    Command(
        "teacher serve",
        "serve /v1/chat/completions (a stand-in teacher for distill)",
        f"{_SERVERS}:teacher_serve",
        (
            _HOST,
            flag("--port", type=PORT, default=8100),
            flag("--mental-max", type=NON_NEGATIVE, default=0, help="answer a*b < this without a tool call"),
            flag(
                "--mental-frac",
                type=FRACTION,
                default=1.0,
                help="the share of those answered without a tool call (default 1)",
            ),
        ),
        common=False,
    ),
    Command(
        "eval",
        "evaluate a checkpoint, a model directory or the SFT policy on the episode path: accuracy (greedy), avg@K "
        "and pass@K; registers scored checkpoints",
        f"{_FLOWS}:evaluate",
        (
            flag(
                "--model",
                type=Path,
                default=None,
                help=f"{_MODEL} (default: the newest checkpoint, else the SFT policy)",
            ),
            flag("--checkpoint", type=NON_NEGATIVE, default=None, metavar="STEP", help="evaluate checkpoint STEP"),
            flag("--env", default=None, help=_ENV, sets="env.name"),
            flag(
                "--tasks",
                default=None,
                help="problem set or benchmark file, JSONL/Parquet, local or s3:// (default: the environment's "
                "held-out set)",
            ),
            flag(
                "--benchmark",
                default=None,
                help="format of --tasks: aime2025, hmmt, beyondaime, imoanswerbench (default: detected)",
            ),
            flag(
                "--samples",
                type=POSITIVE,
                default=1,
                help="K > 1: K sampled episodes per task besides the greedy one, for avg@K and pass@K; 1 (default): "
                "the greedy episode only",
            ),
        ),
    ),
    Command(
        "plan",
        "per-GPU memory of the preset's training (weights, gradients, optimizer, activations) for each ZeRO stage "
        "and critic placement, and the cheapest configuration that fits; with rollout servers, the rollout GPUs that "
        "keep the trainer fed and the weight sync's time (docs/gpu.md)",
        f"{_LOCAL}:plan",
        (
            PRESET,
            overrides_flag("rollout.max_total_tokens=32768"),
            flag("--gpus", type=POSITIVE, required=True, help="GPUs per node that train (torchrun's ranks per node)"),
            flag("--nodes", type=POSITIVE, default=1, help="nodes that train, each with --gpus GPUs (default 1)"),
            flag(
                "--gpu-memory-gb",
                type=POSITIVE_NUMBER,
                default=141.0,
                help="memory of one GPU for training, in GB of 1e9 bytes (default 141: an H200; 80 or less: an H100)",
            ),
            flag(
                "--link-gb-s",
                type=POSITIVE_NUMBER,
                default=50.0,
                help="bytes/s of one GPU's link between nodes, in GB/s, for the weight sync (default 50: a 400 Gb/s "
                "InfiniBand NIC)",
            ),
            flag(
                "--mean-tokens",
                type=POSITIVE,
                default=None,
                help="mean tokens of a trajectory, for the rollout side (default half of rollout.max_total_tokens)",
            ),
        ),
        common=False,
    ),
    Command(
        "rehearse",
        "a GPU preset run as it is on this CPU, in bf16, with only the model shrunk and the endpoints local: two "
        "DeepSpeed ranks under torchrun, value pretraining, RL against two servers over the collective transfer, a "
        "kill and a resume; `sao:` lines name what the shrink changes (docs/gpu.md)",
        f"{_LOCAL}:rehearse",
        (
            flag("--preset", required=True, help="a GPU preset under components/presets (qwen3-30b-a3b, ...)"),
            flag("--home", type=Path, default=None, help="an empty or new directory (default .sao-rehearse/PRESET)"),
        ),
        common=False,
    ),
    Command(
        "model init",
        "write a freshly initialised preset model as an HF directory",
        f"{_LOCAL}:model_init",
        (flag("--out", type=Path, required=True), flag("--seed", type=NON_NEGATIVE, default=0)),
    ),
    Command(
        "rollout",
        "run agent episodes with the SFT policy and write them as Parquet",
        f"{_LOCAL}:rollout",
        (
            flag("--env", default=None, help=_ENV, sets="env.name"),
            flag("--episodes", type=POSITIVE, default=32),
            flag("--out", type=Path, required=True, help="output .parquet path"),
            flag("--model", type=Path, default=None, help=f"{_MODEL} (default: the SFT policy)"),
            flag("--tasks", default=None, help="problem set (JSONL/Parquet, local or s3://)", sets="env.tasks"),
        ),
    ),
    Command(
        "train",
        "asynchronous RL from the SFT policy (SAO or a baseline)",
        f"{_FLOWS}:train",
        (
            flag(
                "--algo",
                default=None,
                help=f"{', '.join(typing.get_args(AlgoName))} (default: the preset's)",
                sets="train.algo",
            ),
            flag(
                "--max-steps",
                type=POSITIVE,
                default=None,
                help="policy updates (default: the preset's)",
                sets="train.max_steps",
            ),
            flag("--resume", action="store_true", help="continue from the newest complete checkpoint"),
            flag(
                "--policy",
                default=None,
                metavar="DIR",
                help="start from this HF model directory instead of the SFT stage's policy (sets sft.policy)",
                sets="sft.policy",
            ),
            flag(
                "--rollback-to",
                type=NON_NEGATIVE,
                default=None,
                metavar="STEP",
                help="delete the checkpoints after STEP, then resume from STEP (docs/runbooks)",
            ),
            flag(
                "--replay",
                type=Path,
                default=None,
                metavar="RUN",
                help="train again on the batches RUN recorded (its home, a sweep seed's home or its batches/ "
                "folder), without the engine: bit-identical to the run, or a study of the same batches with --set "
                "overrides; --max-steps stops it early (docs/stability.md)",
            ),
            flag(
                "--critic",
                type=Path,
                default=None,
                help="pretrained critic directory (from `sao value-pretrain`; sets train.critic_path)",
                sets="train.critic_path",
            ),
        ),
    ),
    Command(
        "sweep",
        "train one config with N RL seeds from one SFT policy; writes a table of final accuracy, collapses and "
        "diagnostics (re-running continues)",
        f"{_LOCAL}:sweep",
        (
            flag("--seeds", type=POSITIVE, required=True, help="number of RL seeds (train.task_seed values)"),
            flag("--first-seed", type=NON_NEGATIVE, default=1, help="first train.task_seed (default 1)"),
            flag("--name", default=None, help="sweep directory under <home>/sweeps (default: a hash of the config)"),
        ),
    ),
    Command(
        "engine serve",
        "serve an HF model directory over the OpenAI-compatible API",
        f"{_SERVERS}:engine_serve",
        (
            flag("--model", type=Path, required=True, help=_MODEL),
            _HOST,
            flag("--port", type=PORT, default=8000),
            flag("--max-batch", type=POSITIVE, default=64, help="sequences decoded together at most"),
            flag(
                "--threads",
                type=POSITIVE,
                default=None,
                help="torch CPU threads (default: torch's); leave cores free for clients on the same host",
            ),
            flag(
                "--dtype",
                choices=("float32", "bfloat16"),
                default="float32",
                help="the dtype the model computes in (default float32; bfloat16 as a vLLM GPU server serves)",
            ),
            flag(
                "--publish-root",
                type=Path,
                default=None,
                help="load posted weights only from inside this directory (required, with $SAO_WEIGHTS_TOKEN, "
                "beyond loopback)",
            ),
        ),
    ),
)
"""Every `sao` command, in the order `sao --help` lists them."""
