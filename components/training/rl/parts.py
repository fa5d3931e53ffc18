"""What the training loop uses, built in one place: `build_parts` makes the rollouts, the buffer and its intake,
the runner and its task stream, the checkpointer and the collapse guard around a learner, after resuming from the
newest checkpoint when asked. `components/training/rl/trainer.py`'s `train` is its one caller in the library; the
flows, the CLI and the sweep reach it through `stages.train`, the benchmarks directly.

A run home holding checkpoints of an earlier run is refused unless `resume` says to continue it, and a checkpoint
trained from other starting weights is refused as well: a resume never mixes two runs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from components.agent.runner import AgentRunner, episode_limits
from components.config import Config
from components.contracts.environment import EnvSetup
from components.contracts.task import Task
from components.contracts.trajectory import Trajectory
from components.models import load_chat
from components.rollout.backends import Rollouts, open_rollouts
from components.storage import HomeStateError, weights_fingerprint
from components.tracking import Tracker
from components.training.engines.collective import rank_cores
from components.training.engines.loading import load_policy_config
from components.training.rl.buffer import TrajectoryBuffer
from components.training.rl.checkpoint import (
    Checkpointer,
    CheckpointStore,
    OnCheckpoint,
    checkpoint_store,
    read_payload,
)
from components.training.rl.guard import CollapseGuard
from components.training.rl.learner import Learner
from components.training.rl.stability import CollapseDetector

Log = Callable[[str], None]


@dataclass(frozen=True)
class RunStart:
    step: int
    """Policy version the run starts from (0, or the resumed checkpoint's step)."""
    cursor: int
    """Prompt index of the task stream the run continues from."""
    origin: str
    """Fingerprint of the starting (SFT) weights; every checkpoint carries it."""
    fresh: bool
    """No checkpoint existed: the run starts from the SFT weights."""


@dataclass
class TrainerParts:
    cfg: Config
    setup: EnvSetup
    """The environment, its task stream and its per-step hook."""
    learner: Learner
    tokenizer: object
    rollouts: Rollouts
    """Where episodes are generated, and where new versions are published."""
    buffer: TrajectoryBuffer
    checkpoints: Checkpointer
    guard: CollapseGuard
    tracker: Tracker
    start: RunStart
    intake: Intake | None = None
    """Where the runner hands finished episodes (to the buffer); None in a replay."""
    runner: AgentRunner | None = None
    """None in a replay (components/training/rl/replay.py): its batches are recorded."""
    tasks: Iterator[Task] = field(default_factory=lambda: iter(()))
    """The training tasks from the start's cursor on (none in a replay)."""


def thread_budget(cfg: Config, cores: int | None = None) -> tuple[int, int]:
    """(engine, trainer) torch CPU threads. torch's thread count is per thread, so the engine thread and the
    trainer thread each get their own share of the cores. The embedded engine gets half of them in both modes:
    while it generates, the rest serve the tool calls and the agent runner (a second engine thread on 2 cores
    made synchronous GRPO 23% slower and the async loop 2x slower: its small decode steps do not pay for it).
    The trainer gets the rest in async mode, where both run at once, and every core in sync mode, where they
    take turns; with external engines (`rollout.backend = "http"`) it has them all. Explicit
    `rollout.engine_threads` / `train.threads` win."""
    cores = cores or rank_cores()  # this rank's share under torchrun
    if cfg.rollout.backend == "http":
        return cfg.rollout.engine_threads or cores, cfg.train.threads or cores
    engine = cfg.rollout.engine_threads or max(1, cores // 2)
    if cfg.train.sync:
        return engine, cfg.train.threads or cores
    return engine, cfg.train.threads or max(1, cores - engine)


def build_parts(
    cfg: Config,
    setup: EnvSetup,
    learner: Learner,
    sft_dir: Path,
    home: Path,
    tracker: Tracker,
    engine_threads: int,
    resume: bool = False,
    log: Log = print,
    detector: CollapseDetector | None = None,
    on_checkpoint: OnCheckpoint | None = None,
) -> TrainerParts:
    """The loop's parts for `learner` (rank 0's) trained from `sft_dir`, continuing the newest checkpoint when
    `resume`. `detector` is the collapse rule (default: `CollapseDetector()`); `on_checkpoint(step, uri)` is called
    after each checkpoint is complete in the store."""
    tc = cfg.train
    chat = load_chat(sft_dir, cfg.model.chat_format)  # refuses a directory whose format it cannot use, at start
    tokenizer = chat.tokenizer
    window = getattr(load_policy_config(sft_dir), "max_position_embeddings", None)
    if window is not None and cfg.rollout.max_total_tokens > window:
        raise ValueError(
            f"rollout.max_total_tokens: {cfg.rollout.max_total_tokens} is past the policy's window, "
            f"max_position_embeddings = {window} in {sft_dir}/config.json: the trainer would score positions its "
            f"rope was not set for (set the window in the model directory's config.json, where the servers read it)"
        )
    store = checkpoint_store(cfg, home)
    guard = CollapseGuard.from_config(tc, detector)
    start = resume_from(store, learner, guard, tracker, sft_dir, resume, log)
    guard.floor = start.step  # the guard never returns to weights from before the run's start
    replay = cfg.algo.routing_replay == "r3"
    senders = learner.policy_ranks if cfg.rollout.transfer_senders == "all" else 1
    rollouts = open_rollouts(
        cfg.rollout,
        learner.serving_module(),
        tokenizer,
        home,
        start.step,
        engine_threads,
        log,
        record_routes=replay,
        senders=senders,
    )
    group = learner.settings.group_size
    buffer = TrajectoryBuffer(
        tc.max_staleness,
        tc.batch_size,
        group,
        tc.admission,
        version=start.step,
        max_token_lag=tc.max_token_lag,
        drop_uniform_groups=tc.group_filter == "drop-uniform",
    )
    runner = AgentRunner(
        rollouts.engine, chat, setup.env, episode_limits(cfg), cfg.rollout.concurrency, seed=cfg.task.seed + start.step
    )
    return TrainerParts(
        cfg=cfg,
        setup=setup,
        learner=learner,
        tokenizer=tokenizer,
        rollouts=rollouts,
        buffer=buffer,
        intake=Intake(buffer, limit=max(2 * cfg.rollout.concurrency, 16)),
        runner=runner,
        tasks=setup.train_tasks(start.cursor, group),
        checkpoints=Checkpointer(store, tc.checkpoint_failures, on_checkpoint, log, tc.keep_checkpoints),
        guard=guard,
        tracker=tracker,
        start=start,
    )


def refuse_an_earlier_run(store: CheckpointStore, resume: bool) -> int | None:
    """The newest checkpoint's step (None: none); HomeStateError when there is one and the run does not `resume`.
    `sao train` asks before anything else (components/stages/train.py), so a refusal costs no SFT or pretraining."""
    latest = store.latest_step()
    if latest is not None and not resume:
        raise HomeStateError(
            f"{store.location} holds checkpoints up to step {latest} of an earlier run: pass "
            f"--resume to continue it, or remove them to start over"
        )
    return latest


def resume_from(
    store: CheckpointStore,
    learner: Learner,
    guard: CollapseGuard,
    tracker: Tracker,
    sft_dir: Path,
    resume: bool,
    log: Log = print,
) -> RunStart:
    """Where the run starts: fresh from `sft_dir`, or (`resume`) from the newest checkpoint that loads, with the
    learner's states, the guard's record, the RNG states and the tracker rewound to it."""
    origin = weights_fingerprint(sft_dir)
    latest = refuse_an_earlier_run(store, resume)
    if latest is None:
        return RunStart(0, 0, origin, fresh=True)

    def read(directory: Path) -> dict:
        state = read_payload(directory)["state"]
        if state.get("origin") != origin:
            raise HomeStateError(
                f"{store.location}/step-{state['step']:08d} was trained from other starting weights than "
                f"{sft_dir}; remove {store.location} to start over from them"
            )
        learner.load(directory)
        return state

    found = store.load_latest(log, read=read)
    if found is None:
        raise HomeStateError(
            f"{store.location}: no checkpoint up to step {latest} loads (see above); remove them to start over"
        )
    latest, state = found
    guard.load(state.get("guard", {}))
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
    tracker.rewind(state["step"])
    log(f"train: resumed from {store.location}/step-{latest:08d} (version {state['step']})")
    return RunStart(state["step"], state["cursor"], origin, fresh=False)


class Intake:
    """Where finished episodes go. An episode an engine failed (`engine_error`: a refused request, a malformed
    answer; every server staying down raises `EnginesDown` instead) has nothing to train on: it is dropped and
    its admission slot given back (grouped baselines keep it, since a group needs every member). `limit` such
    episodes in a row end the run."""

    def __init__(self, buffer: TrajectoryBuffer, limit: int) -> None:
        self.buffer, self.limit, self.failing = buffer, limit, 0

    async def put(self, trajectory: Trajectory) -> None:
        if trajectory.finish_reason != "engine_error" or self.buffer.group_size != 1:
            self.failing = 0
            await self.buffer.put(trajectory)
            return
        await self.buffer.discard(trajectory)
        self.failing += 1
        if self.failing >= self.limit:
            raise RuntimeError(
                f"rollout: {self.failing} episodes in a row failed on every engine; the last: "
                f"{trajectory.metadata.get('error', 'no message')}"
            )
