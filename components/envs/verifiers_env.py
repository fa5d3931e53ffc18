"""verifiers environments under SAO (issue 43): a module that exports verifiers' `load_environment(**kwargs)`
(prime-rl's environments hub publishes them as packages) trains like a built-in environment.

    [env]
    entrypoint = "components.envs.verifiers_env:factory"    # or name = "verifiers" (registered in pyproject)
    [env.options]
    module = "my_env"              # the environment's module ("owner/my-env" is read as my_env, as verifiers does)
    args = { num_examples = 500 }  # load_environment's keyword arguments
    held_out_size = 0              # rows of the training set held out when the environment has no eval dataset
    success_threshold = 1.0        # reward at which an episode counts as solved (default: its pass_threshold)

Supported: verifiers 0.3.x's classic API (`verifiers.legacy`, which `import verifiers as vf` still reaches):
`MultiTurnEnv` and its subclasses (`SingleTurnEnv`, `ToolEnv`, `StatefulToolEnv`, ...). 0.4.0 removed that API
for `verifiers.v1` (Taskset/Harness), which published environments do not use yet (docs/environments.md).

What maps to what: each dataset row is a `Task` (its user message; the row's index in metadata), its
`prompt` column the episode's `Prompt` (system message, user message, and the tools: the row's
`info["tool_defs"]` or the environment's, as OpenAI function schemas); the eval dataset (else `held_out_size`
rows split off the training set, else the training set itself, as verifiers' `get_eval_dataset` falls back) the
held-out set; an episode is one verifiers rollout (`verifiers_episode.py`) whose rubric score is the reward.
"""

from __future__ import annotations

import importlib
import signal
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from components.config.fields import MalformedCalls
from components.contracts.environment import EnvContext, EnvSetup
from components.contracts.task import Task
from components.envs.tool_calls import check_mode
from components.envs.verifiers_episode import VerifiersEpisode, function_schema, prompt_of

SUPPORTED = ((0, 3), (0, 4))
"""The verifiers versions with the classic API this adapter drives: >= 0.3, < 0.4."""


@dataclass(frozen=True)
class VerifiersOptions:
    """`[env.options]` of a verifiers environment."""

    module: str
    """The environment's module: `load_environment` is looked up there (hub ids `owner/my-env` -> `my_env`)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `load_environment`."""
    held_out_size: int = 0
    """Without an eval dataset: this many rows at the end of the training set are held out (0: evaluate on the
    training set, as verifiers does)."""
    success_threshold: float | None = None
    """The reward at which an episode counts as solved; None: the environment's `pass_threshold`."""

    @classmethod
    def of(cls, options: dict[str, Any]) -> VerifiersOptions:
        unknown = sorted(set(options) - {"module", "args", "held_out_size", "success_threshold"})
        if unknown:
            raise ValueError(
                f"env.options: unknown key(s) {unknown} for a verifiers environment (module, args, held_out_size, "
                "success_threshold); load_environment's arguments go in env.options.args"
            )
        module = options.get("module")
        if not isinstance(module, str) or not module.strip():
            raise ValueError("env.options.module: name the verifiers environment's module (e.g. 'my_env')")
        args = options.get("args", {})
        if not isinstance(args, dict):
            raise ValueError(f"env.options.args: must be a table of load_environment arguments, got {args!r}")
        held_out = options.get("held_out_size", 0)
        if not isinstance(held_out, int) or isinstance(held_out, bool) or held_out < 0:
            raise ValueError(f"env.options.held_out_size: must be an integer >= 0, got {held_out!r}")
        threshold = options.get("success_threshold")
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)):
            raise ValueError(f"env.options.success_threshold: must be a number, got {threshold!r}")
        return cls(module.replace("-", "_").split("/")[-1], dict(args), held_out, threshold)


def import_verifiers() -> Any:
    """`verifiers`, checked to be a version whose classic API this adapter drives."""
    try:
        import verifiers as vf  # a verifiers environment needs it; nothing else in SAO does
    except ImportError as exc:
        raise ValueError(f"verifiers is not installed ({exc}): pip install 'verifiers==0.3.1'") from exc
    version = tuple(int(p) for p in vf.__version__.split(".")[:2] if p.isdigit())
    if not SUPPORTED[0] <= version < SUPPORTED[1]:
        raise ValueError(
            f"verifiers {vf.__version__} is installed; SAO drives the classic API (load_environment, MultiTurnEnv) "
            "of verifiers 0.3.x, which 0.4 removed: pip install 'verifiers==0.3.1'"
        )
    _keep_signal_handlers()
    return vf


def _keep_signal_handlers() -> None:
    """verifiers' `Environment.__init__` installs process-wide SIGINT and SIGTERM handlers (a teardown, then
    exit 143), which would replace the trainer's, and raises off the main thread (a Prefect task's worker):
    its environment module gets a `signal` of its own that installs nothing. Its atexit teardown stays."""
    from verifiers.legacy.envs import environment  # imported by import_verifiers, after its version check

    environment.signal = SimpleNamespace(
        SIGINT=signal.SIGINT,
        SIGTERM=signal.SIGTERM,
        default_int_handler=signal.default_int_handler,
        signal=lambda signum, handler: None,
    )


def load_verifiers_env(options: VerifiersOptions) -> Any:
    """The environment `options.module`'s `load_environment(**options.args)` returns, checked to be one SAO can
    drive: a `MultiTurnEnv` whose rubric scores one rollout at a time."""
    vf = import_verifiers()
    where = f"env.options.module {options.module!r}"
    try:
        module = importlib.import_module(options.module)
    except ImportError as exc:
        raise ValueError(
            f"{where}: cannot import the verifiers environment ({exc}); install its package or put it on PYTHONPATH"
        ) from exc
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise ValueError(f"{where}: the module has no load_environment(**kwargs), as a verifiers environment exports")
    env = load(**options.args)
    if not isinstance(env, vf.MultiTurnEnv):
        raise ValueError(
            f"{where}: load_environment returned a {type(env).__name__}; SAO runs a verifiers MultiTurnEnv or a "
            "subclass (SingleTurnEnv, ToolEnv, StatefulToolEnv, ...), not an EnvGroup or other Environment"
        )
    if env.requires_group_rollouts:
        raise ValueError(f"{where}: its rubric has group-level reward functions; SAO scores each rollout on its own")
    env.env_id = env.env_id or options.module
    env.env_args = env.env_args or options.args
    return env


class VerifiersEnvironment:
    """A loaded verifiers environment as an SAO `Environment`: `start(task)` opens a rollout on the task's row."""

    def __init__(
        self,
        vf_env: Any,
        name: str,
        success_threshold: float,
        malformed_calls: MalformedCalls = "observe",
        held_out_size: int = 0,
    ) -> None:
        self.vf, self.name, self.success_threshold = vf_env, name, success_threshold
        self.malformed_calls = check_mode(malformed_calls)
        self.where = f"verifiers environment {vf_env.env_id!r}"
        self.tools = tuple(function_schema(t) for t in vf_env.tool_defs or ())
        self.rows = {"train": vf_env.get_dataset()}
        self.held_out_size = held_out_size
        if held_out_size >= len(self.rows["train"]):
            raise ValueError(
                f"env.options.held_out_size: {held_out_size} leaves no training rows of {len(self.rows['train'])}"
            )

    def has_eval_dataset(self) -> bool:
        return self.vf.eval_dataset is not None or self.vf.eval_dataset_source is not None

    def train_tasks(self) -> list[Task]:
        """The training set: the dataset's rows, less the held-out ones when they are split off."""
        end = len(self.rows["train"]) - (0 if self.has_eval_dataset() else self.held_out_size)
        return self._tasks("train", range(end))

    def held_out_tasks(self) -> list[Task]:
        """The eval dataset's rows; else the rows split off the training set; else the training set."""
        if self.has_eval_dataset():
            return self._tasks("eval", range(len(self._rows("eval"))))
        n = len(self.rows["train"])
        return self._tasks("train", range(n - self.held_out_size if self.held_out_size else 0, n))

    def _rows(self, split: str) -> Any:
        """The rows of `split` (`train` or `eval`), the eval dataset built when first asked for."""
        if split == "eval" and "eval" not in self.rows and self.has_eval_dataset():
            self.rows["eval"] = self.vf.get_eval_dataset()
        return self.rows.get(split)

    def _tasks(self, split: str, indices: range) -> list[Task]:
        rows = self._rows(split)
        tasks = []
        for i in indices:
            row = rows[i]
            prompt = self._prompt(row, split, i)
            meta = {"vf_split": split, "vf_row": i, "example_id": row.get("example_id", i)}
            tasks.append(Task(f"{split}-{meta['example_id']}", prompt.user, row.get("answer"), meta))
        return tasks

    def _prompt(self, row: dict[str, Any], split: str, index: int) -> Any:
        info = row.get("info")
        tool_defs = info.get("tool_defs") if isinstance(info, dict) else None
        tools = tuple(function_schema(t) for t in tool_defs) if tool_defs is not None else self.tools
        return prompt_of(row["prompt"], tools, f"{self.where}: {split} row {index}")

    def start(self, task: Task) -> VerifiersEpisode:
        split, index = task.metadata.get("vf_split"), task.metadata.get("vf_row")
        rows = self._rows(split) if split in ("train", "eval") else None
        if rows is None or not isinstance(index, int) or not 0 <= index < len(rows):
            raise ValueError(f"{self.where}: task {task.task_id} is not one of its rows (vf_split, vf_row metadata)")
        row = rows[index]
        return VerifiersEpisode(self, row, self._prompt(row, split, index))


def factory(options: dict[str, Any], context: EnvContext) -> EnvSetup:
    """The verifiers environment `[env.options]` names (see the module docstring), with its dataset as the training
    set and its eval dataset as the held-out set."""
    settings = VerifiersOptions.of(options)
    cfg = context.config
    if cfg.env.tasks or cfg.env.eval_tasks:
        raise ValueError(
            "env.tasks / env.eval_tasks: a verifiers environment brings its own datasets (choose them with "
            "env.options.args, as its load_environment takes them)"
        )
    vf_env = load_verifiers_env(settings)
    threshold = settings.success_threshold if settings.success_threshold is not None else vf_env.pass_threshold
    env = VerifiersEnvironment(vf_env, cfg.env.name, float(threshold), cfg.env.malformed_calls, settings.held_out_size)
    if not env.has_eval_dataset() and not settings.held_out_size:
        context.log(
            f"env: {env.where} has no eval dataset and env.options.held_out_size is 0: evaluation runs on the "
            "training set"
        )
    return EnvSetup(cfg.env.name, env, env.train_tasks(), env.held_out_tasks, tools=env.tools)
