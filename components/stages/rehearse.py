"""`sao rehearse --preset P`: a GPU preset run as it is on this machine's CPU, with only the model shrunk and the
endpoints replaced by local processes, so that what would break the first GPU run breaks here first.

    a tiny Qwen3-MoE (the same class, bf16, untied head, Qwen's vocabulary, built from a config)
    -> `sao teacher serve` (the teacher endpoint) and two `sao engine serve --dtype bfloat16` (the vLLM servers)
    -> torchrun, two gloo ranks: `sao value-pretrain` (distillation, SFT and the critic's pretraining, on the
       preset's own DeepSpeed file, activation checkpointing and micro-batches)
    -> torchrun: `sao train`, a checkpoint every step, killed in its third step (SAO_FAULTS)
    -> torchrun: `sao train --resume`, from the newest complete checkpoint (1 or 2: uploads run in the background)
       to the last step, the servers rewound

Everything else is the preset's: the algorithm, its DeepSpeed config, ZeRO stage, learning rates, the collective
weight transfer with its overlap and the weights probe, the sealed sandbox. What is shrunk is a `--set` override
(sizes that a 2-core machine runs in minutes) and is printed as a `sao:` line with the preset's value, and so is
what no CPU can carry over (CUDA, NCCL, vLLM, the rank count). The result is `<home>/rehearse/rehearse.json`.

The rehearsal shows that the stages start, hand over and resume with the GPU preset's settings, in bf16; it does not
show that the tiny model learns (a 30B model's learning rates on a random model), nor anything about speed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from components.config import Config, ModelConfig, load_config
from components.data.solver_server import SOLVER_MODEL
from components.models import build_policy, save_model_dir
from components.models.tokenizer import config_tokenizer
from components.rollout.engine_process import EngineProcess, free_port
from components.sandbox.run import degraded_reason
from components.training.rl.checkpoint import checkpoint_store

RANKS = 2
KILL_AT = 3
"""`sao train` is killed (SIGKILL, `SAO_FAULTS=trainer.step@3`) in its third step. A checkpoint is saved every step
and uploaded in the background, one in flight: the save of step 2 waited for step 1's, so step 1's is complete at
the kill and step 2's may be; the resume must start from whichever is the newest complete one."""
STEPS = 4

TINY = ModelConfig(
    tokenizer="qwen3",
    chat_format="hermes",
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    num_experts=4,
    experts_per_token=2,
    moe_intermediate_size=64,
    max_position_embeddings=1024,
)
"""The shrunk model: Qwen3-30B-A3B's class (Qwen3MoeForCausalLM) and vocabulary, with an untied head, two layers
of four experts (top 2), 64 wide."""

NOT_CARRIED = (
    "the model: a tiny Qwen3-MoE of the same class and vocabulary (2 layers, 64 wide, 4 experts) stands in for the "
    "preset's; its learning is not rehearsed",
    "CUDA: every rank and server runs on the CPU (DS_ACCELERATOR=cpu); bf16 kernels, memory and speed differ",
    "NCCL: the training ranks and the collective weight transfer use gloo; NCCL's stream and failure semantics are "
    "not rehearsed",
    "vLLM: two `sao engine serve --dtype bfloat16` stand in for the vLLM servers (the same /v1 API and weight "
    "transfer; vLLM's worker extension runs only under `make test-vllm`)",
    "ranks: 2 gloo ranks on one host stand in for the deployment's GPUs",
)
"""What no CPU carries over, whatever the preset."""

CARRIED = (
    "train.algo",
    "train.backend",
    "train.zero_stage",
    "train.deepspeed_config",
    "train.activation_checkpointing",
    "sft.backend",
    "value_pretrain.backend",
    "value_pretrain.warm_start",
    "rollout.backend",
    "rollout.weight_transfer",
    "rollout.transfer_senders",
    "rollout.publish_overlap",
    "rollout.sandbox_degraded",
)
"""Settings the rehearsal runs as the preset has them (recorded in the JSON; `shrinks` never overrides them but
where this host cannot seal the sandbox)."""


class RehearsalFailed(RuntimeError):
    """A stage of the rehearsal failed where it must not (the message names it and its log)."""


@dataclass(frozen=True)
class Shrink:
    """One `--set` override of the preset, and why."""

    key: str
    value: object
    why: str

    def override(self) -> str:
        return f"{self.key}={json.dumps(self.value)}"


def shrinks(cfg: Config, model_dir: Path, teacher: str, urls: list[str], publish_dir: Path) -> list[Shrink]:
    """The overrides that shrink `cfg` to the rehearsal, those the preset already agrees with left out."""
    small = "a 2-core CPU runs it in minutes"
    wanted = [
        Shrink("model.path", str(model_dir), "the tiny model of the same family, built from a config"),
        Shrink("distill.teacher", teacher, "a local `sao teacher serve` stands in for the teacher endpoint"),
        Shrink("distill.model", SOLVER_MODEL, "the name the local teacher serves"),
        Shrink("distill.concurrency", 8, small),
        Shrink("task.train_size", 64, small),
        Shrink("task.eval_size", 8, small),
        Shrink("task.max_turns", 4, small),
        Shrink("task.max_new_tokens", 48, "the tiny model's context"),
        Shrink("sft.steps", 4, small),
        Shrink("sft.batch_size", 8, small),
        Shrink("sft.log_every", 1, "every step in the log"),
        Shrink("value_pretrain.episodes", 16, small),
        Shrink("value_pretrain.max_epochs", 2, small),
        Shrink("rollout.urls", urls, "two local `sao engine serve` stand in for the vLLM servers"),
        Shrink("rollout.server", "sao", "the embedded server's API (vLLM's needs a GPU)"),
        Shrink("rollout.publish_dir", str(publish_dir), "the shared volume, in the home"),
        Shrink("rollout.concurrency", 8, small),
        Shrink("rollout.max_total_tokens", 768, "the tiny model's context"),
        Shrink("rollout.max_wall_s", 300.0, small),
        Shrink("rollout.request_timeout_s", 300.0, small),
        Shrink("rollout.transfer_bucket_mb", 4, "several buckets per version for a model of a few MB"),
        Shrink("rollout.probe_every", 1, "the probe after every version"),
        Shrink("train.max_steps", STEPS, small),
        Shrink("train.batch_size", 8, small),
        Shrink("train.checkpoint_every", 1, "a complete checkpoint before the kill"),
        Shrink("train.micro_batch_tokens", 512, "several micro-batches per rank"),
        Shrink("tracking.prometheus_port", 0, "no exporter port to collide with"),
    ]
    if degraded_reason() is not None:  # this host cannot seal the sandbox: the preset would refuse to start
        wanted.append(Shrink("rollout.sandbox_degraded", "warn", f"this host cannot seal it: {degraded_reason()}"))
    return [s for s in wanted if _value(cfg, s.key) != _normal(s.value)]


def notes(cfg: Config, applied: list[Shrink]) -> list[str]:
    """`sao:` lines: every override with the preset's value, then what no CPU carries over."""
    lines = [
        f"sao: rehearse: {s.key} {json.dumps(_value(cfg, s.key))} -> {json.dumps(s.value)} ({s.why})" for s in applied
    ]
    return lines + [f"sao: rehearse: not carried over: {line}" for line in NOT_CARRIED]


def _value(cfg: Config, key: str):
    section, field = key.split(".")
    value = getattr(getattr(cfg, section), field)
    return list(value) if isinstance(value, tuple) else value


def _normal(value):
    return list(value) if isinstance(value, tuple) else value


def build_model(path: Path) -> Path:
    """The tiny model in bf16, as the preset's directory is: weights, config (dtype bfloat16) and tokenizer."""
    tokenizer = config_tokenizer(TINY.tokenizer)
    model = build_policy(TINY, tokenizer, seed=0, dtype=torch.bfloat16)
    assert not model.config.tie_word_embeddings  # Qwen3-30B-A3B's head is its own
    return save_model_dir(model, tokenizer, path)


@dataclass
class Stage:
    """One command of the rehearsal and what became of it."""

    name: str
    argv: list[str]
    rc: int | None = None
    wall_s: float = 0.0
    log: str = ""
    checkpoint: int | None = None
    """The newest complete checkpoint in the store once the stage ended (read after the killed run only)."""


def _torchrun(stage: str, preset: str, home: Path, sets: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    launcher = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", str(RANKS)]
    overrides = [arg for s in sets for arg in ("--set", s)]
    return [*launcher, "-m", "components.cli", stage, "--preset", preset, "--home", str(home), *overrides, *extra]


def _environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path.cwd())}
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return {**env, **(extra or {})}


def _run(stage: Stage, logs: Path, log: Callable[[str], None], env: dict[str, str] | None = None) -> Stage:
    """Run `stage.argv` to its end, its output in `logs/<name>.log`; whatever it leaves running is killed with it (a
    SIGKILLed `sao train` cannot stop the Prefect temporary server it started)."""
    stage.log = str(logs / f"{stage.name}.log")
    log(f"rehearse: {stage.name}: {' '.join(stage.argv[4:8])} ... (log {stage.log})")
    began = time.perf_counter()
    marker = f"{stage.name}-{os.getpid()}-{time.monotonic_ns()}"
    with open(stage.log, "wb") as out:
        proc = subprocess.Popen(
            stage.argv, stdout=out, stderr=subprocess.STDOUT, env=_environment({**(env or {}), LEFTOVER: marker})
        )
        try:
            stage.rc = proc.wait(timeout=1800)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            stage.rc = proc.wait()
        finally:
            kill_leftovers(marker)
    stage.wall_s = round(time.perf_counter() - began, 1)
    log(f"rehearse: {stage.name}: exit {stage.rc} in {stage.wall_s:.0f} s")
    return stage


LEFTOVER = "SAO_REHEARSE_STAGE"
"""Set to a stage's own marker in its environment, which every process it starts inherits (torchrun starts its
ranks in sessions of their own, so a process group would not hold them)."""


def kill_leftovers(marker: str) -> list[int]:
    """SIGKILL every process of this user whose environment holds `LEFTOVER=marker`; returns their pids."""
    needle, killed = f"{LEFTOVER}={marker}".encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except (OSError, ValueError):  # gone meanwhile, or another user's
            continue
    return killed


def _tail(path: str, lines: int = 30) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def _said(path: str) -> str:
    """The `sao:` lines of a log (what each rank said before it ended), else its tail."""
    said = [line for line in Path(path).read_text(errors="replace").splitlines() if line.startswith("sao:")]
    return "\n".join(dict.fromkeys(said)) or _tail(path)


class _Teacher:
    """`sao teacher serve` on a free loopback port, its output in a file."""

    def __init__(self, log: Path) -> None:
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> _Teacher:
        argv = [sys.executable, "-m", "components.cli", "teacher", "serve", "--port", str(self.port)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_environment())
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/models", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sao teacher serve did not start: {_tail(str(self.log))}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def run_rehearse(preset: str, home: Path, log: Callable[[str], None] = print) -> dict:
    """The rehearsal of `preset` in `home` (module docstring); returns what `rehearse.json` holds. Raises
    `RehearsalFailed` naming the stage, its log and its `sao:` lines when one fails where it must not."""
    cfg = load_config(preset, [])
    work = home / "rehearse"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(work / "model")
    teacher = _Teacher(work / "teacher.log")
    engines = [EngineProcess(model_dir, threads=1, log=work / f"engine-{i}.log", dtype="bfloat16") for i in range(2)]
    applied = shrinks(cfg, model_dir, teacher.url, [e.url for e in engines], work / "published")
    lines = notes(cfg, applied)
    for line in lines:
        log(line)
    sets = [s.override() for s in applied]
    began = time.perf_counter()
    try:
        teacher.start()
        for engine in engines:
            engine.start(wait=False)
        for engine in engines:
            engine.wait_healthy(180)
        stages = _stages(preset, home, sets, work, log)
        served = [engine.health() for engine in engines]
    finally:
        teacher.stop()
        for engine in engines:
            engine.stop()
    result = {
        "preset": preset,
        "home": str(home),
        "overrides": sets,
        "notes": lines,
        "stages": [vars(stage) for stage in stages],
        "servers": [{"version": h.get("version"), "transfer_group": h.get("transfer_group")} for h in served],
        "wall_s": round(time.perf_counter() - began, 1),
        "carried": {key: _value(cfg, key) for key in CARRIED},
        "checkpoint_at_kill": stages[1].checkpoint,
        **_training(cfg, home, stages[-1].log),
    }
    result["failures"] = failures(result)
    (work / "rehearse.json").write_text(json.dumps(result, indent=2) + "\n")
    if result["failures"]:
        raise RehearsalFailed(f"rehearse: {'; '.join(result['failures'])} ({work / 'rehearse.json'})")
    return result


def failures(result: dict) -> list[str]:
    """What the rehearsal must show and did not: every step logged once, the resume from the checkpoint before the
    kill, every version over the collective transfer without a fallback (the last one from as many ranks as the preset
    asks: every rank with `rollout.transfer_senders = "all"`), no server failing the probe, both servers at the last
    version."""
    found = []
    if result["steps_logged"] != list(range(1, STEPS + 1)):
        found.append(f"steps logged {result['steps_logged']}, expected 1..{STEPS} once each")
    newest = result["checkpoint_at_kill"]
    if newest is None or newest < KILL_AT - 2:
        found.append(f"the kill in step {KILL_AT} left the newest complete checkpoint at {newest}, not {KILL_AT - 2}+")
    if result["resumed_from"] != newest:
        found.append(f"the resume started from {result['resumed_from']}, not the newest complete checkpoint {newest}")
    last = result["rows"][-1] if result["rows"] else {}
    if last.get("rollout/transfer_fallbacks") != 0 or not last.get("rollout/publish_bytes"):
        found.append(f"the collective transfer fell back or moved nothing: {last}")
    senders = RANKS if result["carried"].get("rollout.transfer_senders") == "all" else 1
    if last.get("rollout/transfer_senders") != senders:
        found.append(f"the last version was sent by {last.get('rollout/transfer_senders')} rank(s), not {senders}")
    if last.get("rollout/probe_failures") != 0:
        found.append(f"{last.get('rollout/probe_failures')} server(s) failed the weights probe")
    if [s["version"] for s in result["servers"]] != [STEPS, STEPS]:
        found.append(f"the servers ended at versions {[s['version'] for s in result['servers']]}, not {STEPS}")
    return found


def _stages(preset: str, home: Path, sets: list[str], work: Path, log: Callable[[str], None]) -> list[Stage]:
    """Value pretraining (with distillation and SFT before it), then training killed at step `KILL_AT` and resumed."""
    pretrain = _run(Stage("value-pretrain", _torchrun("value-pretrain", preset, home, sets)), work, log)
    _require(pretrain, 0)
    killed = Stage("train", _torchrun("train", preset, home, sets))
    _run(killed, work, log, env={"SAO_FAULTS": f"trainer.step@{KILL_AT}"})
    if killed.rc == 0:
        raise RehearsalFailed(f"rehearse: train: the kill at step {KILL_AT} did not happen (log {killed.log})")
    killed.checkpoint = checkpoint_store(load_config(preset, sets), home).latest_step()
    resumed = _run(Stage("train-resume", _torchrun("train", preset, home, sets, ("--resume",))), work, log)
    _require(resumed, 0)
    return [pretrain, killed, resumed]


def _require(stage: Stage, rc: int) -> None:
    if stage.rc != rc:
        raise RehearsalFailed(f"rehearse: {stage.name} exited {stage.rc} (log {stage.log}):\n{_said(stage.log)}")


def _training(cfg: Config, home: Path, resume_log: str) -> dict:
    """What the training rows say (`<home>/runs/<name>/sao.jsonl`): the steps logged before and after the kill, and
    the transfer's and the probe's figures."""
    rows = [json.loads(line) for line in (home / "runs" / cfg.name / "sao.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r.get("metrics", {})]
    keys = (
        "reward/mean",
        "rollout/publish_bytes",
        "rollout/transfer_s",
        "rollout/transfer_fallbacks",
        "rollout/transfer_retries",
        "rollout/transfer_senders",
        "rollout/probe_median_abs_diff",
        "rollout/probe_max_abs_diff",
        "rollout/probe_failures",
        "rollout/engines_live",
        "trainer/step_s",
    )
    resumed = re.findall(r"train: resumed from \S+ \(version (\d+)\)", Path(resume_log).read_text(errors="replace"))
    return {
        "resumed_from": int(resumed[0]) if resumed else None,
        "steps_logged": [r["step"] for r in steps],
        "rows": [{"step": r["step"], **{k: r["metrics"].get(k) for k in keys}} for r in steps],
    }


def summary(result: dict) -> list[str]:
    """The rehearsal in a few lines: each stage, the steps before and after the kill, the transfer and the probe."""
    lines = [f"rehearse {result['preset']}: {result['wall_s']:.0f} s, {result['home']}/rehearse/rehearse.json"]
    lines += [f"  {s['name']:<15} exit {s['rc']:>3}  {s['wall_s']:>6.0f} s  {s['log']}" for s in result["stages"]]
    rows = result["rows"]
    lines.append(
        f"  training steps logged: {result['steps_logged']} (killed in step {KILL_AT}, "
        f"resumed from {result['resumed_from']}, the newest complete checkpoint then {result['checkpoint_at_kill']})"
    )
    if rows:
        last = rows[-1]
        medians = [r["rollout/probe_median_abs_diff"] for r in rows if r["rollout/probe_median_abs_diff"] is not None]
        lines.append(
            f"  transfer: {last['rollout/publish_bytes'] or 0:.0f} bytes per version to the servers, fallbacks "
            f"{last['rollout/transfer_fallbacks']}, retries {last['rollout/transfer_retries']}; probe median |diff| "
            f"max {max(medians, default=0.0):.2g} (failures {last['rollout/probe_failures']})"
        )
    lines.append(f"  servers at versions {[s['version'] for s in result['servers']]}")
    return lines
