"""What the agent runner and the trainer know of an environment: the episode protocol they drive
(prompt -> [generate <-> env.step]*, docs/design.md, architecture) and the set-up a run is handed (`EnvSetup`:
the environment, its training stream, held-out set and per-step hook).

An `Environment` is created once per run from a task list; `start(task)` opens one `EnvEpisode`. An
episode gives its `Prompt` (question, tools) and turns each model turn (one generation, parsed by the chat
format into content and a tool call or an answer: `components.contracts.chat.ModelTurn`) into either an
observation the model sees next (a tool's output) or the end of the episode with its reward. Episodes never see
the chat format's markup: the format (components/chat) renders prompts and observations as token ids.
Episodes keep their own state, so many run concurrently.

Where an environment comes from (`components/envs/registry.py`): a factory `factory(options) -> EnvSetup`, or
`factory(options, context) -> EnvSetup` when it needs the run's config (`EnvContext`), named by `env.entrypoint`
("package.module:factory") or registered under a name in the `sao.environments` entry-point group (the built-in
tir_math, coding and style are registered there, `components/envs/builtin.py`). `options` is the free table
`[env.options]`. A factory may hand its training and held-out sets as plain task lists: the registry cycles the
training list (reshuffled per epoch by `train.task_seed`), so a resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from components.contracts.chat import ModelTurn, Prompt
from components.contracts.task import Task
from components.contracts.trace import Trace


@dataclass(frozen=True)
class StepResult:
    observation: str | None
    """The tool's output, which the chat format appends as observation tokens (action_mask 0); None when the
    episode ends."""
    done: bool
    """The episode is over."""
    reward: float = 0.0
    """Outcome reward (meaningful when done); it lands on the last action token."""
    finish_reason: str | None = None
    """Why it ended when done: `stop` (answered), `tool_error`, ... (see `Trajectory.finish_reason`)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Environment details for the trajectory's metadata (grading, test counts, ...)."""
    malformed: bool = False
    """The turn's tool call was malformed (bad JSON, unknown tool, missing argument): the runner counts these in
    the trajectory's `metadata["malformed_calls"]`."""


class EnvEpisode(Protocol):
    def prompt(self) -> Prompt:
        """What the first model turn answers: the question and the tools the model may call."""

    async def step(self, turn: ModelTurn, truncated: bool) -> StepResult:
        """React to one model turn; `truncated` is True when the turn hit its token limit."""


class Environment(Protocol):
    name: str
    success_threshold: float
    """An episode whose reward reaches this counts as solved (evaluation's accuracy, avg@k and pass@k)."""

    def start(self, task: Task) -> EnvEpisode:
        """A fresh episode for `task`."""


Prompts = Callable[[int], Iterator[tuple[int, Task]]]
StepHook = Callable[[int], tuple[dict[str, float], str | None]]


def no_hook(step: int) -> tuple[dict[str, float], str | None]:
    """The per-step hook of environments that do not change during a run."""
    return {}, None


@dataclass(frozen=True)
class EnvContext:
    """What a factory that takes a second argument is given besides its options."""

    config: Any
    """The run's whole `components.config.Config` (typed Any: contracts import no other package; read it, never
    change it): seeds, tool time-outs, `env.tasks`, the model."""
    log: Callable[[str], None] = print
    """Where to say something worth a line (a degraded setting, a downloaded-nothing warning)."""


@dataclass
class EnvSetup:
    name: str
    """The environment's name: `env.name` (metric keys `eval/{name}/...`, registered model names)."""
    env: Environment
    """The environment rollouts run episodes in."""
    prompts: Prompts | Sequence[Task]
    """`prompts(start)`: endless `(index, task)` pairs of the training set from prompt index `start` on; each
    task id is unique per index. A factory may give a plain task list instead: the registry cycles it."""
    held_out: Callable[[], list[Task]] | Sequence[Task]
    """Loads the held-out set; called by `eval_tasks`, so a job that never evaluates never reads it (or the list
    itself)."""
    hook: StepHook = field(default=no_hook)
    """What `on_step` runs: the style preference schedule, else `no_hook`."""
    tools: tuple[dict[str, Any], ...] = ()
    """The tool schemas its episodes offer (`Prompt.tools`): SFT renders its traces' prompts with them."""
    teacher: Callable[[], list[Trace]] | None = None
    """Writes the SFT traces of `distill.teacher = "programmatic"`; None when the environment has no teacher of
    its own (then SFT data comes from an endpoint teacher, `sao distill --teacher URL`)."""
    sandboxed: bool = False
    """Its episodes run model-written code in the sandbox (tool calls, grading): `build_env` checks the sandbox
    first (`rollout.sandbox_degraded`)."""

    def train_tasks(self, start: int, group_size: int) -> Iterator[Task]:
        """Endless training tasks from prompt index `start` on (the cursor a checkpoint stores), each prompt
        `group_size` times (ids suffixed `#g{k}` when group_size > 1), with `metadata["cursor"] = index`."""
        if start < 0:
            raise ValueError(f"start: must be >= 0, got {start}")
        if group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {group_size}")
        return self._grouped(start, group_size)

    def _grouped(self, start: int, group_size: int) -> Iterator[Task]:
        for index, task in self.prompts(start):
            for g in range(group_size):
                suffix = f"#g{g}" if group_size > 1 else ""
                yield Task(task.task_id + suffix, task.prompt, task.answer, {**task.metadata, "cursor": index})

    def eval_tasks(self) -> list[Task]:
        """The held-out set: `env.eval_tasks` when set, else the environment's built-in one. For the tiny
        built-in coding and style sets that is the training set itself (eval and train overlap); real
        held-out sets come through `env.eval_tasks`."""
        return self.held_out() if callable(self.held_out) else list(self.held_out)

    def on_step(self, step: int) -> tuple[dict[str, float], str | None]:
        """Called before policy step `step` (0-based count of completed updates): `(metrics, message)`,
        the message (to log) only when something changed, e.g. the style preference flipped."""
        return self.hook(step)
