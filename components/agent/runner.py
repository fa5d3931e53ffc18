"""The asyncio agent runner: prompts in, trajectories out, one at a time, as each episode finishes.

Up to `concurrency` episodes run as asyncio tasks against one engine (embedded or over HTTP). Each episode
alternates two kinds of step:
- model turns: generate until a stop token (end of a tool call, end of the answer) or the per-turn limit;
- environment steps: the tool output is tokenised once and appended as observation tokens.

The episode also has limits on turns, total tokens and wall time. A finished episode is handed over at once
(callback or queue), and nothing waits for other episodes. That is the single-rollout, no-group-barrier
half of SAO. Engine errors and timeouts end the episode with a recorded finish reason; they never drop it.
The exception is `EnginesDown` (every engine server stayed down past `rollout.engine_wait_s`): that is the
run's failure, not the episode's, so it is raised; `run` then starts no new episode and raises it.

Every id goes through the model's chat format (components/chat): the prompt ids, the stop tokens, the parse of
each sampled turn and the observation ids of each tool output. The engine is always sent ids and its sampled
ids are kept as they are, so the trainer sees exactly the ids the engine sampled plus the ids the format
appended: token in, token out, with no retokenisation drift between turns.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import torch

from components.chat.format import ChatFormat
from components.contracts.environment import EnvEpisode, Environment, StepResult
from components.contracts.task import Task
from components.contracts.trajectory import Routes, Timings, Trajectory
from components.models.routing import NOT_RECORDED
from components.rollout.pool import EnginesDown
from components.rollout.protocol import SamplingRequest, SamplingResult

TrajectorySink = Callable[[Trajectory], Awaitable[None] | None]


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    """Model turns per episode."""
    max_new_tokens: int = 48
    """New tokens per model turn."""
    max_total_tokens: int = 512
    """Prompt + actions + observations."""
    max_wall_s: float = 300.0
    """Wall-clock limit per episode (engine waits and tool calls included)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"limits.{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_wall_s <= 0:
            raise ValueError(f"limits.max_wall_s: must be > 0, got {self.max_wall_s}")


def episode_limits(cfg) -> EpisodeLimits:
    """The per-episode limits of a config (`components.config.Config`): rollouts use them as they are,
    evaluation at temperature 0."""
    return EpisodeLimits(
        cfg.task.max_turns,
        cfg.task.max_new_tokens,
        cfg.rollout.max_total_tokens,
        cfg.rollout.max_wall_s,
        cfg.algo.temperature,
    )


@dataclass
class _EpisodeRecord:
    """What one episode has produced so far: the token ids with, per token, the action mask (1: sampled by the
    policy), the log-prob and the weight version (None for prompt and observation tokens), and how it ended."""

    ids: list[int]
    mask: list[int]
    logprobs: list[float | None]
    versions: list[int | None]
    prompt_len: int
    reward: float = 0.0
    turns: int = 0
    reason: str = ""
    """The finish reason; the episode runs until it is set."""
    metadata: dict = field(default_factory=dict)
    malformed: int = 0
    routes: object = None
    """The last model turn's routes (`SamplingResult.routes`): its request held every earlier token, so they cover
    the episode up to that turn's last token."""

    @classmethod
    def of_prompt(cls, ids: list[int]) -> _EpisodeRecord:
        """A record of the prompt alone: `ids` is kept, not copied, and grows with the episode."""
        prompt_len = len(ids)
        return cls(ids, [0] * prompt_len, [None] * prompt_len, [None] * prompt_len, prompt_len)

    def add_sampled(self, result: SamplingResult) -> None:
        """Append a model turn's tokens as the engine sampled them (action mask 1)."""
        self.ids += result.token_ids
        self.mask += [1] * len(result.token_ids)
        self.logprobs += result.logprobs
        self.versions += result.versions
        if result.routes is not None:
            self.routes = result.routes

    def add_observation(self, observation: list[int]) -> None:
        """Append a tool output's tokens (action mask 0: not the policy's)."""
        self.ids += observation
        self.mask += [0] * len(observation)
        self.logprobs += [None] * len(observation)
        self.versions += [None] * len(observation)

    def trajectory(self, task: Task, env_name: str, timings: Timings) -> Trajectory:
        """The finished episode, validated; its metadata is the task's, then what the episode added."""
        return Trajectory(
            task.task_id,
            env_name,
            self.ids,
            self.mask,
            self.logprobs,
            self.versions,
            float(self.reward),
            self.turns,
            self.reason,
            self.prompt_len,
            timings,
            {**task.metadata, **self.metadata, "malformed_calls": self.malformed},
            self._routes(),
        ).validate()

    def _routes(self) -> Routes | None:
        """Every token's routes, -1 past the last turn's (its last token, observations after it)."""
        if self.routes is None:
            return None
        covered = self.routes[: len(self.ids)]
        pad = covered.new_full((len(self.ids) - len(covered), *covered.shape[1:]), NOT_RECORDED)
        return Routes.of(torch.cat([covered, pad]))


class AgentRunner:
    """Runs episodes of `env` against `engine` (anything with `async generate(SamplingRequest)`) in the chat
    format `chat`."""

    def __init__(
        self,
        engine,
        chat: ChatFormat,
        env: Environment,
        limits: EpisodeLimits = EpisodeLimits(),
        concurrency: int = 8,
        seed: int = 0,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        self.engine, self.chat, self.env, self.limits = engine, chat, env, limits
        self.concurrency, self.seed = concurrency, seed
        self.in_flight = 0
        self.max_in_flight = 0

    async def run(
        self,
        tasks: Iterable[Task],
        sink: TrajectorySink | None = None,
        admit: Callable[[Task], Awaitable[None]] | None = None,
        stop: asyncio.Event | None = None,
    ) -> list[Trajectory]:
        """Run tasks (a list or an endless iterator) with at most `concurrency` in flight; each trajectory goes
        to `sink` the moment it finishes. Without a sink, returns them in finish order; with one, the sink owns
        them and the list is empty (an endless run would otherwise hold every trajectory it ever made).

        `admit(task)`, when given, is awaited before each episode starts (the trainer's staleness admission
        control). Setting `stop` starts no new episode; those in flight finish and are handed over. An episode
        that raises (every engine down, or the sink refused its trajectory) does the same, and `run` then
        raises the first such error.
        """
        slots = asyncio.Semaphore(self.concurrency)
        finished: list[Trajectory] = []
        running: set[asyncio.Task] = set()
        errors: list[Exception] = []
        failed = asyncio.Event()

        async def one(task: Task, queued: float) -> None:
            try:
                trajectory = await self.run_episode(task, queued)
                if sink is None:
                    finished.append(trajectory)
                    return
                maybe = sink(trajectory)
                if asyncio.iscoroutine(maybe):
                    await maybe
            except Exception as exc:
                errors.append(exc)
                failed.set()
            finally:
                slots.release()

        for task in tasks:
            queued = time.time()
            await slots.acquire()
            if failed.is_set() or (stop is not None and stop.is_set()):
                slots.release()
                break
            if admit is not None:
                # Admission may wait for trajectories that will never come once an episode has failed.
                if not await _unless(admit(task), failed) or (stop is not None and stop.is_set()):
                    slots.release()
                    break
            job = asyncio.create_task(one(task, queued))
            running.add(job)
            job.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running)
        if errors:
            raise errors[0]
        return finished

    async def run_episode(self, task: Task, queued: float | None = None) -> Trajectory:
        """One episode; never raises for engine, tool or time-limit failures (they become the finish reason)."""
        timings = Timings(queued=queued if queued is not None else time.time(), started=time.time())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            episode = self.env.start(task)
            record = _EpisodeRecord.of_prompt(self.chat.prompt_ids(episode.prompt()))
            await self._play(task, episode, record, timings)
        finally:
            self.in_flight -= 1
        timings.finished = time.time()
        return record.trajectory(task, self.env.name, timings)

    async def _play(self, task: Task, episode: EnvEpisode, record: _EpisodeRecord, timings: Timings) -> None:
        """Alternate model turns and environment steps until a limit, the engine or the environment ends the
        episode; `record.reason` then says which."""
        limits = self.limits
        deadline = time.monotonic() + limits.max_wall_s
        while not record.reason:
            budget = min(limits.max_new_tokens, limits.max_total_tokens - len(record.ids))
            if record.turns >= limits.max_turns:
                record.reason = "max_turns"
                break
            if budget < 1:
                record.reason = "max_tokens"
                break
            result = await self._generate(task, record, budget, deadline)
            if record.reason:  # the deadline passed or the engine failed
                break
            record.turns += 1
            if record.turns == 1:
                timings.first_token = time.time()
            record.add_sampled(result)
            step = await self._step(episode, result, record, deadline)
            if record.reason:  # the deadline passed
                break
            record.malformed += step.malformed
            if step.done:
                record.reward, record.reason = step.reward, step.finish_reason or "stop"
                record.metadata.update(step.info)
                break
            observation = self.chat.observation_ids(step.observation)
            if len(record.ids) + len(observation) >= limits.max_total_tokens:
                record.reason = "max_tokens"
                break
            record.add_observation(observation)

    async def _generate(
        self, task: Task, record: _EpisodeRecord, budget: int, deadline: float
    ) -> SamplingResult | None:
        """The next model turn of at most `budget` tokens, or None with `record.reason` (and the error) set when
        the deadline passed or the engine failed. `EnginesDown` is the run's failure, so it propagates."""
        request = SamplingRequest(
            list(record.ids),
            budget,
            self.limits.temperature,
            self.chat.stop_token_ids,
            seed=zlib.crc32(f"{self.seed}:{task.task_id}:{record.turns}".encode()),
        )
        try:
            result = await asyncio.wait_for(self.engine.generate(request), deadline - time.monotonic())
        except TimeoutError:
            record.reason = "timeout"
            return None
        except EnginesDown:
            raise
        except Exception as exc:  # any other engine failure ends this episode, recorded, never dropped
            record.reason, record.metadata["error"] = "engine_error", f"{type(exc).__name__}: {exc}"
            return None
        if result.finish_reason == "abort":
            record.reason, record.metadata["error"] = "engine_error", "the engine aborted the request"
            return None
        return result

    async def _step(
        self, episode: EnvEpisode, result: SamplingResult, record: _EpisodeRecord, deadline: float
    ) -> StepResult | None:
        """The environment's answer to the sampled turn, or None with `record.reason` set when the deadline passed
        first."""
        truncated = result.finish_reason == "length"
        text = self.chat.tokenizer.decode(
            result.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )  # exactly what was sampled: a tokenizer_config's clean-up would rewrite " ." in code
        turn = self.chat.parse(text, truncated)
        try:
            return await asyncio.wait_for(episode.step(turn, truncated), deadline - time.monotonic())
        except TimeoutError:
            record.reason = "timeout"
            return None


async def _unless(awaitable: Awaitable[None], event: asyncio.Event) -> bool:
    """Await `awaitable` unless `event` is set first, in which case it is cancelled. True when it completed."""
    job = asyncio.ensure_future(awaitable)
    flag = asyncio.ensure_future(event.wait())
    await asyncio.wait({job, flag}, return_when=asyncio.FIRST_COMPLETED)
    flag.cancel()
    if job.done():
        job.result()
        return True
    job.cancel()
    await asyncio.gather(job, return_exceptions=True)
    return False
