"""The asynchronous RL loop: trajectories stream from the agent runner into the trainer, one algorithm step per
batch, weights published to the engine after every step (docs/design.md, architecture).

    runner (asyncio, C episodes) --finished trajectory--> buffer --B in arrival order--> step --> publish v+1

In async mode nothing waits for a group. The buffer's admission control bounds staleness. In sync mode
(`train.sync`), a batch is generated, all of it is awaited, and then the trainer trains on it. Both modes
run the same code, so async and sync are measured on equal terms.

The loop (`Trainer.run`) reads as a recipe: take a batch, step, publish, log, checkpoint, watch for a collapse.
What it uses comes in as `TrainerParts` (components/training/rl/parts.py builds them once for the flows, the CLI,
the sweep and the benchmarks): the learner, the rollouts, the buffer and the runner, the checkpointer with its
failure budget, the collapse guard and the tracker. Observers (`on_step`) see every step's batch and row, which
is how the loop benchmark watches it.

Under torchrun (DeepSpeed backend) rank 0 runs everything here and the learner splits each batch over the
ranks (components/training/rl/learner.py); the result is the single-process step of the whole batch.

Departures:
- with the embedded engine (`rollout.backend = "embedded"`) the trainer and the engine share one process,
  each with its own share of the CPU threads, and weights move in memory, never through a file.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from components.config import Config, TrainConfig, to_dict
from components.contracts.environment import EnvSetup
from components.contracts.trajectory import Trajectory, to_tensors
from components.faults import fault_point
from components.models import save_model_dir
from components.storage import atomic_dir
from components.tracking import Tracker
from components.training.engines import memory
from components.training.engines.schedule import warmup_cosine
from components.training.rl.algorithms import settings_from
from components.training.rl.buffer import BatchesExhausted, TrajectoryBuffer
from components.training.rl.checkpoint import OnCheckpoint
from components.training.rl.learner import Learner
from components.training.rl.parts import TrainerParts, build_parts, thread_budget
from components.training.rl.recording import BATCHES, BatchRecorder
from components.training.rl.stability import CollapseDetector

Observer = Callable[["Trainer", list[Trajectory], dict], None]
"""Called with (trainer, batch, row) after every step's row is logged."""

HISTORY_ROWS = 10_000
"""Per-step metric rows a run keeps in memory for its `TrainResult` (about 3 KB each)."""
TRAINED_IDS = 100_000
"""Trajectory ids a run keeps in memory for its `TrainResult`."""


@dataclass
class TrainResult:
    steps: int
    """Policy updates done in this run (a resumed run counts from its checkpoint)."""
    version: int
    """Final policy version."""
    policy_dir: Path | None
    """HF directory of the final policy."""
    history: list[dict]
    """Per-step metrics of the last `HISTORY_ROWS` steps (the tracker has every step; a long run keeps a window)."""
    seconds: float = 0.0
    """Wall time of the training loop (from the first wait for a batch to the last step)."""
    idle_seconds: float = 0.0
    """Of which the trainer waited for trajectories."""
    trajectories: int = 0
    """Trajectories trained on."""
    rollbacks: int = 0
    """Times the collapse guard restored an earlier checkpoint (over the whole run, resumes included)."""
    trained_ids: list[str] = field(default_factory=list)
    """Task ids of the last `TRAINED_IDS` trajectories trained on, in order. The task stream gives every episode
    its own id, so a repeat would be an episode trained twice (e.g. a request retried on another engine and kept
    both times)."""


def lr_scale(tc: TrainConfig, step: int) -> float:
    """Both learning rates at 0-based step `step`, as a fraction of the configured ones: linear warm-up over
    `warmup_steps`, then cosine decay to `min_lr_ratio` at `max_steps` (docs/stability.md says why)."""
    return warmup_cosine(step, tc.max_steps, 1.0, tc.min_lr_ratio, tc.warmup_steps)


def train(
    cfg: Config,
    setup: EnvSetup,
    sft_dir: Path,
    home: Path,
    tracker: Tracker,
    resume: bool = False,
    log: Callable[[str], None] = print,
    detector: CollapseDetector | None = None,
    on_checkpoint: OnCheckpoint | None = None,
    on_step: list[Observer] | None = None,
) -> TrainResult:
    """Train from `sft_dir` on `setup`'s environment and task stream; the policy lands in
    `models/<name>-<algo>-policy` under `home`. Under torchrun every rank calls this; rank 0 runs the loop and
    returns the result, the other ranks serve rank 0's steps and return an empty result. `detector` is the
    collapse rule (tests pass a hair-trigger one); `on_checkpoint(step, uri)` is called after each checkpoint is
    complete in the store (the train flow emits `sao.checkpoint.saved` from it); `on_step` observe the loop."""
    engine_threads, trainer_threads = thread_budget(cfg)
    learner = Learner(cfg, sft_dir, settings_from(cfg), trainer_threads)
    if not learner.is_driver:
        learner.serve()
        learner.close()
        return TrainResult(0, 0, None, [])

    async def run() -> TrainResult:
        parts = build_parts(
            cfg, setup, learner, sft_dir, home, tracker, engine_threads, resume, log, detector, on_checkpoint
        )
        out = Path(home) / "models" / f"{cfg.name}-{cfg.train.algo}-policy"
        observers = list(on_step or [])
        if cfg.train.record_batches:
            observers.append(
                BatchRecorder(Path(home) / BATCHES, cfg, sft_dir, trainer_threads, learner.comm.world, parts.start)
            )
        return await Trainer(cfg.train, parts, out, log, observers).run()

    try:
        return asyncio.run(run())
    finally:
        learner.release()
        learner.close()


class Trainer:
    """One run of the loop on `parts`, from `parts.start` to `tc.max_steps` (or the guard's end)."""

    def __init__(
        self,
        tc: TrainConfig,
        parts: TrainerParts,
        out_dir: Path,
        log: Callable[[str], None] = print,
        on_step: list[Observer] | None = None,
        stop_at: int | None = None,
    ) -> None:
        self.tc, self.parts, self.out_dir, self.log = tc, parts, out_dir, log
        self.stop_at = stop_at or tc.max_steps
        """The version after which the loop ends (a replay may stop early; the schedule stays `tc.max_steps`'s)."""
        self.on_step = list(on_step or [])
        self.step, self.cursor = parts.start.step, parts.start.cursor
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY_ROWS)
        self.trained_ids: collections.deque[str] = collections.deque(maxlen=TRAINED_IDS)
        self.updates = self.trajectories = 0
        self.idle = self.loop_s = 0.0
        self.lagged: collections.deque = collections.deque()  # weights not yet published (train.sync_lag)
        self.learner_thread_id: int | None = None
        """Native id of the thread the learner's steps run on (one thread for the whole run)."""
        self._learner_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sao-learner")

    async def run(self) -> TrainResult:
        p, tc = self.parts, self.tc
        if p.start.fresh and p.guard.active:
            self.save_checkpoint()  # the starting weights: the guard always has a checkpoint to return to
        env_row = self._task_hook(first=True)
        stop = asyncio.Event()
        producer = None
        try:  # from here on, whatever fails, the rollouts' probes and connections end in `finally`
            await p.rollouts.start()  # every server samples the first batches from the weights the trainer holds
            if not tc.sync and p.runner is not None:  # a replay has no runner: its batches are recorded
                producer = asyncio.create_task(p.runner.run(p.tasks, p.intake.put, p.buffer.admit, stop))
            p.tracker.log_params({"config": to_dict(p.cfg), "resumed_at": self.step})
            self.started = self.last_row = time.perf_counter()
            while self.step < self.stop_at:
                env_row = self._task_hook() if self.step != self._hooked else env_row
                try:
                    batch, waited = await self._next_batch(producer)
                except BatchesExhausted as end:
                    self.log(str(end))
                    break
                metrics, step_s = await self._update(batch)
                publish_s = await self._publish()
                row = self._record(batch, metrics, waited, step_s, publish_s, env_row)
                if self.step == tc.max_steps or (tc.checkpoint_every and self.step % tc.checkpoint_every == 0):
                    self.save_checkpoint()
                if not await self._watch(row["reward/mean"]):
                    break
        finally:
            stop.set()
            await p.buffer.close()
            try:
                if producer is not None:
                    await producer
            finally:  # also when the producer failed (every engine down): its probes and connections end here
                await p.rollouts.close()
                self._learner_thread.shutdown()
        with atomic_dir(self.out_dir) as tmp:
            save_model_dir(p.learner.serving_module(), p.tokenizer, tmp)
        p.checkpoints.wait()  # the last checkpoint's upload ran beside the export; the run ends once it is stored
        return TrainResult(
            self.updates,
            self.step,
            self.out_dir,
            list(self.history),
            seconds=self.loop_s,
            idle_seconds=self.idle,
            trajectories=self.trajectories,
            rollbacks=p.guard.rollbacks,
            trained_ids=list(self.trained_ids),
        )

    # ---- the loop's parts, in the order the loop calls them --------------------------------------------------

    def _task_hook(self, first: bool = False) -> dict[str, float]:
        """The environment's per-step hook (the style preference schedule): its metrics from now on. A change
        (a preference flip) drops the reward on purpose: the guard starts over, and a new task's starting
        weights are checkpointed, as what the guard may return to."""
        p = self.parts
        self._hooked = self.step
        metrics, message = p.setup.on_step(self.step)
        if message:
            self.log(message)
            p.guard.task_changed(self.step, hold=self.tc.max_staleness + 1)
            if not first and p.guard.active and p.checkpoints.latest_step() != self.step:
                self.save_checkpoint()
        return metrics

    async def _next_batch(self, producer: asyncio.Task | None) -> tuple[list[Trajectory], float]:
        """The next `batch_size` trajectories (sync mode: generated now, in task order) and the seconds waited."""
        p, n = self.parts, self.tc.batch_size
        began = time.perf_counter()
        if self.tc.sync:  # a sync batch comes from the version just published: its transfer must have ended
            await p.rollouts.settle()
        while self.tc.sync and p.runner is not None and p.buffer.ready < n:  # generate one batch, wait for all of it
            await p.runner.run(itertools.islice(p.tasks, n - p.buffer.ready), p.intake.put)
        batch = await _take(p.buffer, n, producer)
        if self.tc.sync:  # one batch, one policy: task order rather than finish order makes runs reproducible
            batch.sort(key=lambda t: (t.metadata.get("cursor", 0), t.prompt_id))
        waited = time.perf_counter() - began
        self.idle += waited
        return batch, waited

    async def _update(self, batch: list[Trajectory]) -> tuple[dict, float]:
        """One algorithm step on `batch`; the version moves on. Returns (metrics, seconds)."""
        p = self.parts
        began = time.perf_counter()
        tensors = to_tensors(batch, p.tokenizer.pad_token_id)
        self.scale = p.guard.lr_scale * lr_scale(self.tc, self.step)
        loop = asyncio.get_running_loop()
        update_policy = self.step >= self.tc.critic_warmup_steps  # the critic's warm-up: its updates only
        metrics = await loop.run_in_executor(
            self._learner_thread, self._learner_step, tensors, self.scale, update_policy, self.step
        )
        fault_point("trainer.step")  # the weights moved, the version is not yet counted nor published
        self.step += 1
        self.cursor = max(t.metadata.get("cursor", 0) for t in batch) + 1
        return metrics, time.perf_counter() - began

    def _learner_step(self, tensors: dict, scale: float, update_policy: bool = True, version: int = -1) -> dict:
        self.learner_thread_id = threading.get_native_id()
        return self.parts.learner.step(tensors, scale, update_policy, version)

    async def _weights(self, copy: bool, version: int) -> dict:
        """The policy's weights for the engines as `version`, gathered on the learner's thread: under ZeRO-3 every rank
        joins the gathers and the copies to the host take seconds at 30B, while the event loop goes on serving the
        rollouts. With `rollout.transfer_senders = "all"` the other ranks stage their share of it meanwhile."""
        p = self.parts
        share = p.rollouts.share(version)
        return await asyncio.get_running_loop().run_in_executor(self._learner_thread, p.learner.weights, copy, share)

    async def _publish(self) -> float:
        """Send the weights of version `step - sync_lag` to the engines; returns the seconds it took (with
        `rollout.publish_overlap`, only until they are staged). An engine that loads before `publish` returns may
        get the live weights as they are: nothing moves them until the next step. A lagged version, or one the
        rollouts keep to send later, must be a copy."""
        p, began = self.parts, time.perf_counter()
        copy = bool(self.tc.sync_lag) or p.rollouts.keeps_weights
        self.lagged.append((self.step, await self._weights(copy, self.step)))
        if len(self.lagged) > self.tc.sync_lag:  # versions are consecutive: the oldest is `step - sync_lag`
            version, weights = self.lagged.popleft()
            await p.rollouts.publish(weights, version)
        await p.buffer.set_version(self.step)
        return time.perf_counter() - began

    def _record(
        self,
        batch: list[Trajectory],
        metrics: dict,
        waited: float,
        step_s: float,
        publish_s: float,
        env_row: dict[str, float],
    ) -> dict:
        """The step's row: logged, kept in the history, shown to the observers and as a progress line."""
        p, now = self.parts, time.perf_counter()
        row = step_row(metrics, batch, self.step, waited, step_s, self.idle, now - self.started, now - self.last_row)
        self.last_row = now
        row.update(
            {
                "trainer/publish_s": publish_s,
                "trainer/lr_scale": self.scale,
                "trainer/rollbacks": float(p.guard.rollbacks),
                **env_row,
                **_skipped_steps(p.learner),
                "trainer/checkpoint_failures": float(p.checkpoints.failed),
                **p.rollouts.metrics(),
                "rollout/episodes_dropped": float(p.buffer.discarded),
                **({"rollout/evicted": float(p.buffer.evicted)} if self.tc.max_token_lag is not None else {}),
                **({"rollout/groups_dropped": float(p.buffer.groups_dropped)} if self.tc.group_filter != "off" else {}),
            }
        )
        self.history.append(row)
        self.updates += 1
        self.trajectories += len(batch)
        self.trained_ids.extend(t.prompt_id for t in batch)
        self.loop_s = time.perf_counter() - self.started
        p.tracker.log_metrics(row, self.step)
        for observer in self.on_step:
            observer(self, batch, row)
        self.log(progress_line(self.step, self.tc.max_steps, row))
        return row

    async def _watch(self, reward: float) -> bool:
        """The collapse guard after step `step`; False when the run ends here. A rollback's restored weights go
        out as a new version: versions only ever grow."""
        p = self.parts
        collapse = p.guard.check(self.step, reward)
        if collapse is None:
            return True
        if not p.guard.active:
            self.log(f"train: collapse at step {self.step} ({collapse.cause}); train.collapse_guard=off, continuing")
            return True
        p.checkpoints.wait()  # the guard returns only to a checkpoint complete in the store
        restored = p.guard.roll_back(collapse, p.checkpoints.store, p.learner, self.log)
        if restored is None:
            return False
        self.step += 1
        self.lagged.clear()
        await p.rollouts.publish(await self._weights(True, self.step), self.step)
        await p.buffer.set_version(self.step)
        p.tracker.log_metrics(
            {"trainer/rollbacks": float(p.guard.rollbacks), "trainer/rollback_to": restored}, self.step
        )
        self.log(
            f"train: rolled back to the checkpoint of step {restored} as version {self.step} "
            f"(rollback {p.guard.rollbacks})"
        )
        self.save_checkpoint()
        return not p.guard.ends

    def save_checkpoint(self) -> None:
        """Checkpoint the learner, the loop's position, the guard's record and the RNG states at `step`: written
        locally here (every rank), published on the checkpointer's thread while the loop goes on."""
        p = self.parts
        try:
            p.checkpoints.save(
                self.step,
                {
                    "state": {
                        "step": self.step,
                        "cursor": self.cursor,
                        "world_size": p.learner.comm.world,
                        "origin": p.start.origin,
                        "guard": p.guard.state(),
                        "torch_rng": torch.get_rng_state(),
                        "py_rng": random.getstate(),
                    },
                },
                final=self.step >= self.tc.max_steps,
                write=p.learner.save,
            )
        finally:  # what the steps and the checkpoint's I/O freed since the last one goes back to the OS
            memory.trim()


async def _take(buffer: TrajectoryBuffer, n: int, producer: asyncio.Task | None) -> list[Trajectory]:
    """The next batch; re-raises the runner's error instead of waiting forever if the runner died."""
    take = asyncio.create_task(buffer.take(n))
    if producer is None:
        return await take
    done, _ = await asyncio.wait({take, producer}, return_when=asyncio.FIRST_COMPLETED)
    if take in done:
        return take.result()
    take.cancel()
    producer.result()  # raises the runner's exception
    raise RuntimeError("the agent runner stopped before the trainer had its batch")


def step_row(
    metrics: dict,
    batch: list[Trajectory],
    version: int,
    waited: float,
    step_s: float,
    idle: float,
    elapsed: float,
    interval: float,
) -> dict:
    """The step's metrics row. Rates are over `interval`, the wall-clock time since the previous step's row
    (consecutive intervals tile the run): a batch's own time span would overstate them in async mode, where
    the episodes of consecutive batches run at the same time."""
    row = {k: float(v) for k, v in metrics.items()}
    stale = [version - 1 - v for t in batch for v, m in zip(t.versions, t.action_mask) if m]
    tokens = sum(t.num_actions for t in batch)
    row.update(
        {
            "reward/mean": sum(t.reward for t in batch) / len(batch),
            "rollout/staleness_mean": sum(stale) / max(len(stale), 1),
            "rollout/staleness_max": float(max(stale, default=0)),
            "rollout/turns_mean": sum(t.turns for t in batch) / len(batch),
            "rollout/length_mean": sum(len(t.token_ids) for t in batch) / len(batch),
            "rollout/action_tokens": float(tokens),
            "rollout/malformed_calls": float(sum(t.metadata.get("malformed_calls", 0) for t in batch)),
            "rollout/trajectories_per_s": len(batch) / max(interval, 1e-9),
            "rollout/tokens_per_s": tokens / max(interval, 1e-9),
            "trainer/step_s": step_s,
            "trainer/idle_frac": idle / max(elapsed, 1e-9),
            "trainer/wait_s": waited,
        }
    )
    return row


def _skipped_steps(learner: Learner) -> dict[str, float]:
    """Updates skipped for non-finite inputs, losses or gradients, over the run (saved in checkpoints): policy
    updates, and critic updates (K per step) when there is a critic. Every rank skips together, so rank 0's
    engines count for all."""
    row = {"trainer/skipped_steps": float(learner.policy.skipped_steps)}
    if learner.critic is not None:
        row["trainer/critic_skipped_steps"] = float(learner.critic.skipped_steps)
    return row


def progress_line(step: int, max_steps: int, row: dict) -> str:
    return (
        f"step {step:>4}/{max_steps}  reward {row['reward/mean']:.3f}  "
        f"stale {row['rollout/staleness_mean']:.2f}/{row['rollout/staleness_max']:.0f}  "
        f"masked {row.get('dis/masked_frac_low', 0):.3f}/{row.get('dis/masked_frac_high', 0):.3f}  "
        f"EV {row.get('critic/explained_variance', float('nan')):.2f}  "
        f"{row['rollout/trajectories_per_s']:.1f} traj/s  idle {row['trainer/idle_frac']:.0%}"
    )
