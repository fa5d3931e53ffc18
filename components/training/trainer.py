"""The asynchronous RL loop: trajectories stream from the agent runner into the trainer, one algorithm step per
batch, weights published to the engine after every step (DESIGN section 3).

    runner (asyncio, C episodes) --finished trajectory--> buffer --B in arrival order--> step --> publish v+1

In async mode nothing waits for a group. The buffer's admission control bounds staleness. In sync mode
(`train.sync`), a batch is generated, all of it is awaited, and then the trainer trains on it. Both modes
run the same code, so async and sync are measured on equal terms.

Under torchrun (DeepSpeed backend) rank 0 runs everything here and the learner splits each batch over the
ranks (components/training/learner.py); the result is the single-process step of the whole batch.

Both learning rates follow `lr_scale` (warm-up, cosine decay), and a collapse guard watches the reward
(`components/training/stability.py`): when the collapse rule fires it restores the newest checkpoint from
before the collapse as a new policy version. docs/stability.md has the mechanism and the evidence.

The environment and its task stream come in as an `EnvSetup` (components/envs/registry.py, chosen by
`env.name`); checkpoints go to the artifact store (`store.uri`: the run home, a path or S3).

Departures:
- with the embedded engine (`rollout.backend = "embedded"`) the trainer and the engine share one process,
  each with its own share of the CPU threads, and weights move in memory, never through a file.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from components.agent.runner import AgentRunner, episode_limits
from components.config import Config, TrainConfig, to_dict
from components.contracts.trajectory import Trajectory, to_tensors
from components.faults import fault_point
from components.models import load_tokenizer, save_model_dir, stop_token_ids
from components.rollout.backends import EmbeddedRollouts, HttpRollouts, Rollouts
from components.storage import (HomeStateError, StoreError, atomic_dir, weights_fingerprint)
from components.tracking import Tracker
from components.training.algorithms import ALGORITHMS, AlgoSettings
from components.training.buffer import TrajectoryBuffer
from components.training.checkpoint import CheckpointStore, checkpoint_store
from components.training import memory
from components.training.learner import Learner
from components.training.schedule import warmup_cosine
from components.training.stability import Collapse, CollapseDetector

if TYPE_CHECKING:  # the trainer is handed an environment; it imports none
    from components.contracts.environment import EnvSetup

OnCheckpoint = Callable[[int, str], None]
"""Called with (step, URI) once a checkpoint is complete in the store."""


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


HISTORY_ROWS = 10_000
"""Per-step metric rows a run keeps in memory for its `TrainResult` (about 3 KB each)."""
TRAINED_IDS = 100_000
"""Trajectory ids a run keeps in memory for its `TrainResult`."""


def thread_budget(cfg: Config, cores: int | None = None) -> tuple[int, int]:
    """(engine, trainer) torch CPU threads. torch's thread count is per thread, so the engine thread and the
    trainer thread each get their own share of the cores. The embedded engine gets half of them in both modes:
    while it generates, the rest serve the tool calls and the agent runner (a second engine thread on 2 cores
    made synchronous GRPO 23% slower and the async loop 2x slower: its small decode steps do not pay for it).
    The trainer gets the rest in async mode, where both run at once, and every core in sync mode, where they
    take turns; with external engines (`rollout.backend = "http"`) it has them all. Explicit
    `rollout.engine_threads` / `train.threads` win."""
    cores = cores or len(os.sched_getaffinity(0))
    if cfg.rollout.backend == "http":
        return cfg.rollout.engine_threads or cores, cfg.train.threads or cores
    engine = cfg.rollout.engine_threads or max(1, cores // 2)
    if cfg.train.sync:
        return engine, cfg.train.threads or cores
    return engine, cfg.train.threads or max(1, cores - engine)


def lr_scale(tc: TrainConfig, step: int) -> float:
    """Both learning rates at 0-based step `step`, as a fraction of the configured ones: linear warm-up over
    `warmup_steps`, then cosine decay to `min_lr_ratio` at `max_steps` (docs/stability.md says why)."""
    return warmup_cosine(step, tc.max_steps, 1.0, tc.min_lr_ratio, tc.warmup_steps)


def settings_from(cfg: Config) -> AlgoSettings:
    algorithm = ALGORITHMS[cfg.train.algo]
    eps_low, eps_high = cfg.algo.dis_window
    return AlgoSettings(cfg.algo.gamma, cfg.algo.lam_critic, cfg.algo.lam_policy, eps_low, eps_high,
                        cfg.algo.temperature, algorithm.critic_updates or cfg.algo.critic_updates,
                        cfg.algo.value_clip, cfg.algo.normalize_advantages,
                        group_size=cfg.train.group_size if algorithm.grouped else 1)


def open_rollouts(cfg: Config, module: torch.nn.Module, tokenizer, home: Path, version: int,
                  engine_threads: int) -> Rollouts:
    """Where episodes are generated (`rollout.backend`): the embedded engine on a copy of `module` in this
    process, or the `rollout.urls` servers, which load each version from `rollout.publish_dir`."""
    rc = cfg.rollout
    backends: dict[str, Callable[[], Rollouts]] = {
        "embedded": lambda: EmbeddedRollouts(module, tokenizer, rc.max_batch, version, engine_threads),
        "http": lambda: HttpRollouts(list(rc.urls), module, tokenizer, Path(rc.publish_dir or home / "published"),
                                     rc.server, rc.request_timeout_s, rc.request_retries, version,
                                     max_wait_s=rc.engine_wait_s),
    }
    return backends[rc.backend]()


def train(cfg: Config, setup: EnvSetup, sft_dir: Path, home: Path, tracker: Tracker, resume: bool = False,
          log: Callable[[str], None] = print, detector: CollapseDetector | None = None,
          on_checkpoint: OnCheckpoint | None = None) -> TrainResult:
    """Train from `sft_dir` on `setup`'s environment and task stream. Under torchrun every rank calls this;
    rank 0 runs the agent loop and returns the result, the other ranks serve rank 0's steps and return an
    empty result. `detector` is the collapse rule (default: `CollapseDetector()`, the one definition; tests
    pass a hair-trigger one). `on_checkpoint(step, uri)` is called after each checkpoint is complete in the
    store (the train flow emits `sao.checkpoint.saved` from it)."""
    engine_threads, trainer_threads = thread_budget(cfg)
    learner = Learner(cfg, sft_dir, settings_from(cfg), trainer_threads)
    if not learner.is_driver:
        learner.serve()
        learner.close()
        return TrainResult(0, 0, None, [])
    try:
        return asyncio.run(_train(cfg, setup, learner, sft_dir, home, tracker, resume, engine_threads, log,
                                  detector or CollapseDetector(), on_checkpoint or (lambda step, uri: None)))
    finally:
        learner.release()
        learner.close()


async def _train(cfg: Config, setup: EnvSetup, learner: Learner, sft_dir: Path, home: Path, tracker: Tracker,
                 resume: bool, engine_threads: int, log, detector: CollapseDetector,
                 on_checkpoint: OnCheckpoint) -> TrainResult:
    tc = cfg.train
    tokenizer = load_tokenizer(sft_dir)
    store = checkpoint_store(cfg, home)
    step, cursor, origin = 0, 0, weights_fingerprint(sft_dir)
    guard = {"rollbacks": 0, "lr_scale": 1.0}  # the collapse guard's record, carried in checkpoints
    latest = store.latest_step()
    if latest is not None and not resume:
        raise HomeStateError(f"{store.location} holds checkpoints up to step {latest} of an earlier run: pass "
                             f"--resume to continue it, or remove them to start over")
    found = store.load_latest(log) if resume and latest is not None else None
    if found is not None:
        latest, saved = found
        if saved["state"].get("origin") != origin:
            raise HomeStateError(f"{store.location}/step-{latest:08d} was trained from other starting weights than "
                                 f"{sft_dir}; remove {store.location} to start over from them")
        learner.load_state_dicts(saved)
        step, cursor = saved["state"]["step"], saved["state"]["cursor"]
        guard.update(saved["state"].get("guard", {}))
        torch.set_rng_state(saved["state"]["torch_rng"])
        random.setstate(saved["state"]["py_rng"])
        tracker.rewind(step)
        log(f"train: resumed from {store.location}/step-{latest:08d} (version {step})")
    elif latest is not None:
        raise HomeStateError(f"{store.location}: no checkpoint up to step {latest} loads (see above); remove them "
                             f"to start over")

    saves = {"stored": 0, "failed_in_a_row": 0, "failed": 0}  # this process's checkpoints

    def save_checkpoint() -> None:
        try:
            _save_checkpoint()
        finally:  # what the steps and the checkpoint's I/O freed since the last one goes back to the OS
            memory.trim()

    def _save_checkpoint() -> None:
        try:
            uri = store.save(step, {
                **learner.state_dicts(),
                "state": {"step": step, "cursor": cursor, "world_size": learner.comm.world, "origin": origin,
                          "guard": dict(guard), "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()},
            })
        except StoreError as exc:  # the store's retries are spent: an outage, or a store that never worked
            saves["failed"] += 1
            saves["failed_in_a_row"] += 1
            if not saves["stored"] or step >= tc.max_steps or saves["failed_in_a_row"] > tc.checkpoint_failures:
                raise
            log(f"train: checkpoint {step} not stored ({exc}); training goes on, {saves['failed_in_a_row']} of "
                f"train.checkpoint_failures={tc.checkpoint_failures} in a row")
            return
        saves["stored"] += 1
        saves["failed_in_a_row"] = 0
        on_checkpoint(step, uri)

    if latest is None and tc.collapse_guard != "off":
        save_checkpoint()  # the starting weights: the guard always has a checkpoint to return to

    policy = learner.policy
    rollouts = open_rollouts(cfg, policy.module, tokenizer, home, step, engine_threads)
    group = learner.settings.group_size
    buffer = TrajectoryBuffer(tc.max_staleness, tc.batch_size, group, tc.admission, version=step)
    runner = AgentRunner(rollouts.engine, tokenizer, setup.env, episode_limits(cfg), cfg.rollout.concurrency,
                         tuple(stop_token_ids(tokenizer)), seed=cfg.task.seed + step)
    tasks = setup.train_tasks(cursor, group)
    env_row, _ = _env_step(setup, step, log, detector, tc.max_staleness)  # e.g. the style preference from now on
    regime = step  # the guard never rolls back to weights trained for an earlier task (a preference flip)
    intake = _Intake(buffer, limit=max(2 * cfg.rollout.concurrency, 16))
    stop = asyncio.Event()
    producer = None if tc.sync else asyncio.create_task(runner.run(tasks, intake.put, buffer.admit, stop))
    tracker.log_params({"config": to_dict(cfg), "resumed_at": step})
    history: collections.deque[dict] = collections.deque(maxlen=HISTORY_ROWS)
    updates = 0
    lagged: collections.deque = collections.deque()  # weights not yet published (train.sync_lag)
    run_start, idle, loop_s, trajectories = time.perf_counter(), 0.0, 0.0, 0
    last_row = run_start  # when the previous step's row was made: consecutive rows span the wall clock
    trained_ids: collections.deque[str] = collections.deque(maxlen=TRAINED_IDS)
    env_step = step
    try:
        while step < tc.max_steps:
            if step != env_step:
                (env_row, changed), env_step = _env_step(setup, step, log, detector, tc.max_staleness), step
                if changed and tc.collapse_guard != "off":
                    regime = step
                    if store.latest_step() != step:
                        save_checkpoint()  # the task's starting weights: what the guard may return to
            wait_start = time.perf_counter()
            while tc.sync and buffer.ready < tc.batch_size:  # generate one batch, wait for all of it
                await runner.run(itertools.islice(tasks, tc.batch_size - buffer.ready), intake.put)
            batch = await _take(buffer, tc.batch_size, producer)
            if tc.sync:  # one batch, one policy: task order rather than finish order makes runs reproducible
                batch.sort(key=lambda t: (t.metadata.get("cursor", 0), t.prompt_id))
            waited = time.perf_counter() - wait_start
            idle += waited
            step_start = time.perf_counter()
            tensors = to_tensors(batch, tokenizer.pad_token_id)
            scale = guard["lr_scale"] * lr_scale(tc, step)
            metrics = await asyncio.to_thread(learner.step, tensors, scale)
            fault_point("trainer.step")  # the weights moved, the version is not yet counted nor published
            step += 1
            step_s = time.perf_counter() - step_start
            # Publishing awaits the engines, so with no lag the live weights can go as they are: nothing moves
            # them until the next step. A lagged version must be a copy.
            lagged.append((step, _weights(policy) if tc.sync_lag else _live_weights(policy)))
            if len(lagged) > tc.sync_lag:  # versions are consecutive: the oldest is `step - sync_lag`
                version, weights = lagged.popleft()
                await rollouts.publish(weights, version)
            await buffer.set_version(step)
            cursor = max(t.metadata.get("cursor", 0) for t in batch) + 1
            now = time.perf_counter()
            row = _row(metrics, batch, step, waited, step_s, idle, now - run_start, now - last_row)
            row["trainer/publish_s"] = now - step_start - step_s
            last_row = now
            row.update({"trainer/lr_scale": scale, "trainer/rollbacks": float(guard["rollbacks"]), **env_row,
                        **_skipped_steps(learner), "trainer/checkpoint_failures": float(saves["failed"]),
                        **rollouts.metrics(), "rollout/episodes_dropped": float(buffer.discarded)})
            history.append(row)
            updates += 1
            trajectories += len(batch)
            trained_ids.extend(t.prompt_id for t in batch)
            loop_s = time.perf_counter() - run_start
            tracker.log_metrics(row, step)
            log(_progress_line(step, tc.max_steps, row))
            if step == tc.max_steps or (tc.checkpoint_every and step % tc.checkpoint_every == 0):
                save_checkpoint()
            collapse = detector.update(step, row["reward/mean"])
            if collapse is None:
                continue
            if tc.collapse_guard == "off":
                log(f"train: collapse at step {step} ({collapse.cause}); train.collapse_guard=off, continuing")
                continue
            restored = _roll_back(collapse, store, learner, guard, tc, log, floor=regime)
            if restored is None:
                break
            ending = _guard_ends(guard, tc)
            step += 1  # the restored weights go out as a new version: versions only ever grow
            lagged.clear()
            await rollouts.publish(_weights(policy), step)
            await buffer.set_version(step)
            detector.reset()
            tracker.log_metrics({"trainer/rollbacks": float(guard["rollbacks"]), "trainer/rollback_to": restored},
                                step)
            log(f"train: rolled back to the checkpoint of step {restored} as version {step} "
                f"(rollback {guard['rollbacks']})")
            save_checkpoint()
            if ending:
                break
    finally:
        stop.set()
        await buffer.close()
        try:
            if producer is not None:
                await producer
        finally:  # also when the producer failed (every engine down): its probes and connections end here
            await rollouts.close()
    out = home / "models" / f"{cfg.name}-{tc.algo}-policy"
    with atomic_dir(out) as tmp:
        save_model_dir(policy.module, tokenizer, tmp)
    return TrainResult(updates, step, out, list(history), seconds=loop_s, idle_seconds=idle,
                       trajectories=trajectories, rollbacks=guard["rollbacks"], trained_ids=list(trained_ids))


def _roll_back(collapse: Collapse, store: CheckpointStore, learner: Learner, guard: dict, tc: TrainConfig,
               log: Callable[[str], None], floor: int = 0) -> int | None:
    """The collapse guard (docs/stability.md): load the newest checkpoint from before the collapse's onset, and
    not before step `floor` (the current task's start), into the learner and update the guard's record
    (count, learning-rate factor). Returns the restored step, or None when there is none to return to."""
    found = store.load_latest(log, at_most=collapse.last_good_step)
    if found is None or found[0] < floor:
        log(f"train: collapse at step {collapse.step} ({collapse.cause}) and no checkpoint between steps {floor} "
            f"and {collapse.onset} to roll back to; stopping")
        return None
    restored, saved = found
    learner.load_state_dicts(saved)
    guard["rollbacks"] += 1
    if not _guard_ends(guard, tc):
        guard["lr_scale"] *= tc.rollback_lr_scale
    log(f"train: collapse at step {collapse.step} ({collapse.cause}); "
        + ("rolling back and stopping" if _guard_ends(guard, tc) else
           f"rolling back, learning rates now x{guard['lr_scale']:g}"))
    return restored


def _guard_ends(guard: dict, tc: TrainConfig) -> bool:
    """After a rollback: does the run end there (`stop`, or more rollbacks than `max_rollbacks`)?"""
    return tc.collapse_guard == "stop" or guard["rollbacks"] > tc.max_rollbacks


class _Intake:
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
            raise RuntimeError(f"rollout: {self.failing} episodes in a row failed on every engine; the last: "
                               f"{trajectory.metadata.get('error', 'no message')}")


def _env_step(setup: EnvSetup, step: int, log: Callable[[str], None], detector: CollapseDetector,
              max_staleness: int) -> tuple[dict[str, float], bool]:
    """The environment's per-step hook (the style preference schedule): (its metrics, whether the task
    changed), logging the change. A change (a preference flip) drops the reward on purpose: the collapse rule
    starts over, and skips the next `max_staleness + 1` batches, which still hold episodes of the old task."""
    metrics, message = setup.on_step(step)
    if message:
        log(message)
        detector.reset(hold=max_staleness + 1)
    return metrics, bool(message)


def _weights(policy) -> dict[str, torch.Tensor]:
    """A copy of the policy's weights (one that later steps do not move)."""
    return {k: v.detach().clone() for k, v in _live_weights(policy).items()}


def _live_weights(policy) -> dict[str, torch.Tensor]:
    """The policy's weights as they are (no copy): valid until the next optimizer step."""
    return {k: v.detach() for k, v in policy.module.state_dict().items()}


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


def _row(metrics: dict, batch: list[Trajectory], version: int, waited: float, step_s: float, idle: float,
         elapsed: float, interval: float) -> dict:
    """The step's metrics row. Rates are over `interval`, the wall-clock time since the previous step's row
    (consecutive intervals tile the run): a batch's own time span would overstate them in async mode, where
    the episodes of consecutive batches run at the same time."""
    row = {k: float(v) for k, v in metrics.items()}
    stale = [version - 1 - v for t in batch for v, m in zip(t.versions, t.action_mask) if m]
    tokens = sum(t.num_actions for t in batch)
    row.update({
        "reward/mean": sum(t.reward for t in batch) / len(batch),
        "rollout/staleness_mean": sum(stale) / max(len(stale), 1),
        "rollout/staleness_max": float(max(stale, default=0)),
        "rollout/turns_mean": sum(t.turns for t in batch) / len(batch),
        "rollout/length_mean": sum(len(t.token_ids) for t in batch) / len(batch),
        "rollout/action_tokens": float(tokens),
        "rollout/trajectories_per_s": len(batch) / max(interval, 1e-9),
        "rollout/tokens_per_s": tokens / max(interval, 1e-9),
        "trainer/step_s": step_s,
        "trainer/idle_frac": idle / max(elapsed, 1e-9),
        "trainer/wait_s": waited,
    })
    return row


def _skipped_steps(learner: Learner) -> dict[str, float]:
    """Updates skipped for non-finite inputs, losses or gradients, over the run (saved in checkpoints): policy
    updates, and critic updates (K per step) when there is a critic. Every rank skips together, so rank 0's
    engines count for all."""
    row = {"trainer/skipped_steps": float(learner.policy.skipped_steps)}
    if learner.critic is not None:
        row["trainer/critic_skipped_steps"] = float(learner.critic.skipped_steps)
    return row


def _progress_line(step: int, max_steps: int, row: dict) -> str:
    return (f"step {step:>4}/{max_steps}  reward {row['reward/mean']:.3f}  "
            f"stale {row['rollout/staleness_mean']:.2f}/{row['rollout/staleness_max']:.0f}  "
            f"masked {row.get('dis/masked_frac_low', 0):.3f}/{row.get('dis/masked_frac_high', 0):.3f}  "
            f"EV {row.get('critic/explained_variance', float('nan')):.2f}  "
            f"{row['rollout/trajectories_per_s']:.1f} traj/s  idle {row['trainer/idle_frac']:.0%}")
