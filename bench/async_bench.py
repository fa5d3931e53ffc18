"""Asynchronous single-rollout SAO vs synchronous GRPO (issue 5), measured in one run on equal terms.

Every arm runs the same trainer loop (`components.training.rl.trainer.train`) with the same embedded engine,
the same SFT policy (the preset's, built once under the home), the same batch of 16 trajectories per policy
update, and the same heavy-tailed simulated tool latency (lognormal, seeded per episode), which stands in
for real tools: sandboxes, search, compilers.

- `sao` async, capacity admission, 48 episodes in flight: one rollout per prompt, trained the moment 16
  have finished. 48 = (max_staleness 2 + 1) x 16, the most the staleness bound lets start.
- `sao` async with 16 in flight: the same concurrency as the synchronous arm.
- `sao` async with the `oldest` admission rule (one straggler stalls every new start), 48 in flight.
- `grpo` sync: 2 prompts x a group of 8, all 16 in flight; generate the batch, wait for all of it, train.

Reported per arm: trajectories per second, trainer idle fraction (time waiting for trajectories over loop
time) and time to reach the same number of policy updates; then the ratios. Goal: >= 2.5x throughput with
idle < 15%.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from components.config import load_config
from components.envs.registry import build_env
from components.stages.sft import run_sft
from components.tracking import NullTracker
from components.training.rl.parts import thread_budget
from components.training.rl.trainer import train

STEPS = int(os.environ.get("BENCH_ASYNC_STEPS", "20"))
HEAVY_TAIL = ['rollout.latency="lognormal"', "rollout.latency_mean_s=0.5", "rollout.latency_sigma=1.5"]
NO_LATENCY = ['rollout.latency="none"']
COMMON = [f"train.max_steps={STEPS}", "train.batch_size=16", "train.max_staleness=2", "train.checkpoint_every=0"]
SAO = ['train.algo="sao"', "train.sync=false"]
SAO_ASYNC = SAO + ["rollout.concurrency=48"]
GRPO_SYNC = ['train.algo="grpo"', "train.sync=true", "train.group_size=8", "rollout.concurrency=16"]
ARMS = {
    "sao async, C=48": SAO_ASYNC,
    "sao async, C=16": SAO + ["rollout.concurrency=16"],
    "sao async, oldest rule": SAO_ASYNC + ['train.admission="oldest"'],
    "grpo sync, groups of 8": GRPO_SYNC,
}


def _arm(name: str, overrides: list[str], sft_dir: Path) -> dict:
    cfg = load_config("tiny-cpu", COMMON + overrides)
    engine_threads, trainer_threads = thread_budget(cfg)
    with tempfile.TemporaryDirectory() as home:
        result = train(cfg, build_env(cfg), sft_dir, Path(home), NullTracker(), log=lambda _: None)
    first_wait = result.history[0]["trainer/wait_s"]
    row = {
        "arm": name,
        "traj_per_s": result.trajectories / result.seconds,
        "idle": result.idle_seconds / result.seconds,
        "seconds": result.seconds,
    }
    idle_after_first = (result.idle_seconds - first_wait) / max(result.seconds - first_wait, 1e-9)
    staleness_max = max(r["rollout/staleness_max"] for r in result.history)
    staleness_mean = sum(r["rollout/staleness_mean"] for r in result.history) / len(result.history)
    reward = sum(r["reward/mean"] for r in result.history) / len(result.history)
    print(
        f"  {name:<23} threads {engine_threads}+{trainer_threads}  {result.steps} updates in "
        f"{result.seconds:6.1f} s: {row['traj_per_s']:5.2f} traj/s, trainer idle {row['idle']:4.0%} "
        f"({idle_after_first:4.0%} after the first batch), staleness mean {staleness_mean:.2f} max "
        f"{staleness_max:.0f}, mean reward {reward:.2f}",
        flush=True,
    )
    return row


def _compare(sao: dict, grpo: dict) -> str:
    return (
        f"{sao['arm']} / {grpo['arm']}: throughput {sao['traj_per_s'] / grpo['traj_per_s']:.2f}x, "
        f"time to {STEPS} updates {grpo['seconds'] / sao['seconds']:.2f}x shorter, trainer idle "
        f"{sao['idle']:.0%} vs {grpo['idle']:.0%}"
    )


def run() -> None:
    home = Path(os.environ.get("SAO_HOME", ".sao"))
    print(
        f"async vs sync: {STEPS} policy updates x 16 trajectories per arm, staleness bound 2; SFT policy from "
        f"{home} (built first if missing)",
        flush=True,
    )
    sft_dir = run_sft(load_config("tiny-cpu"), home, log=lambda line: print(f"  {line}", flush=True))
    print("heavy-tailed tool latency: lognormal, mean 0.5 s, sigma 1.5", flush=True)
    rows = [_arm(name, HEAVY_TAIL + overrides, sft_dir) for name, overrides in ARMS.items()]
    grpo = rows[-1]
    for row in rows[1:-1]:
        print(f"  {_compare(row, grpo)}")
    print(f"  {_compare(rows[0], grpo)}  (goal: >= 2.5x, idle < 15%)")
    print("no tool latency (generation and training only)", flush=True)
    plain = [_arm(name, NO_LATENCY + ARMS[name], sft_dir) for name in ("sao async, C=48", "grpo sync, groups of 8")]
    print(f"  {_compare(*plain)}")
