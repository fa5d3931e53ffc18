"""Environments chosen by config: `build_env(cfg)` finds the factory `env.entrypoint` or `env.name` names, calls it
with `[env.options]` and checks what it returns; `sft_traces(cfg)` is its teacher's SFT data.

A factory is found by `env.entrypoint = "package.module:factory"` (imported as is: a module on `PYTHONPATH`
is enough), else by `env.name` in the `sao.environments` entry-point group (an installed package registers its
environments there; the built-in tir_math, coding and style are registered the same way, by this project's
pyproject.toml). Whatever goes wrong (a module that cannot be imported, a missing attribute, a factory that
raises or returns something other than an `EnvSetup`, a task without a prompt) is one `EnvFactoryError`
naming the entry point and what was wrong: the CLI prints it as one `sao:` line.

A training set given as a task list is cycled: epoch `e` visits each task once, in an order shuffled by
`Random(f"{train.task_seed}:{e}")`, ids `{task_id}@{index}`; a pure function of (seed, start), so a run
resumed from the cursor a checkpoint stores continues exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import entry_points
from typing import Any

from components.config import Config
from components.contracts.environment import EnvContext, EnvSetup
from components.contracts.task import Task
from components.contracts.trace import Trace
from components.envs.sandbox_check import check_sandbox

ENTRY_POINT_GROUP = "sao.environments"
"""The entry-point group packages register environment factories in (`name = "package.module:factory"`)."""

CHECKED_TASKS = 8
"""How many tasks of the training stream and of the held-out set are checked when an environment is built."""


class EnvFactoryError(ValueError):
    """An environment factory could not be found, failed, or returned something unusable (a ValueError: the CLI
    prints it as one `sao:` line and exits 2)."""


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch `epoch` visits the `n` tasks of a cycled set."""
    order = list(range(n))
    random.Random(f"{seed}:{epoch}").shuffle(order)  # str seeds hash with SHA-512: stable across processes
    return order


def cycled_prompts(tasks: list[Task], seed: int, start: int) -> Iterator[tuple[int, Task]]:
    """A finite set cycled from `start` on, reshuffled per epoch (`epoch_order`); ids `{task_id}@{index}`."""
    n = len(tasks)
    if n == 0:
        raise ValueError("tasks: cannot cycle an empty training set")
    for epoch in itertools.count(start // n):
        order = epoch_order(n, seed, epoch)
        for position in range(max(start - epoch * n, 0), n):
            index, task = epoch * n + position, tasks[order[position]]
            yield index, Task(f"{task.task_id}@{index}", task.prompt, task.answer, dict(task.metadata))


def registered() -> dict[str, str]:
    """Names in the `sao.environments` group and the `module:attr` each points to."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def entrypoint_of(cfg: Config) -> str:
    """The `module:attr` the config names: `env.entrypoint`, else `env.name`'s registered entry point."""
    if cfg.env.entrypoint:
        return cfg.env.entrypoint
    known = registered()
    if cfg.env.name not in known:
        raise EnvFactoryError(
            f"env.name: no environment {cfg.env.name!r} in the {ENTRY_POINT_GROUP!r} entry-point group "
            f"(registered: {sorted(known)}); name one there or set env.entrypoint = 'package.module:factory'"
        )
    return known[cfg.env.name]


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable `module:attr` (dotted attributes allowed) names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise EnvFactoryError(f"env.entrypoint {spec!r}: expected 'package.module:factory'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # a missing module or one that fails on import: both the entry point's fault
        raise EnvFactoryError(f"env.entrypoint {spec!r}: cannot import {module_name!r} ({exc})") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvFactoryError(f"env.entrypoint {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise EnvFactoryError(f"env.entrypoint {spec!r}: {attr} is a {type(obj).__name__}, not a callable")
    return obj


def _call(factory: Callable[..., Any], spec: str, options: dict, context: EnvContext) -> Any:
    """`factory(options, context)`, or `factory(options)` when it takes one argument."""
    try:
        params = inspect.signature(factory).parameters.values()
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_context = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
    except (TypeError, ValueError):  # a builtin without a signature: call it with the options alone
        takes_context = False
    try:
        return factory(options, context) if takes_context else factory(options)
    except EnvFactoryError:
        raise
    except Exception as exc:
        raise EnvFactoryError(f"env.entrypoint {spec!r}: the factory failed: {type(exc).__name__}: {exc}") from exc


def _check_task(task: Any, spec: str, where: str) -> None:
    if not isinstance(task, Task):
        raise EnvFactoryError(f"env.entrypoint {spec!r}: {where} is a {type(task).__name__}, not a Task")
    if not isinstance(task.task_id, str) or not task.task_id:
        raise EnvFactoryError(f"env.entrypoint {spec!r}: {where} has no task_id (got {task.task_id!r})")
    if not isinstance(task.prompt, str) or not task.prompt.strip():
        raise EnvFactoryError(f"env.entrypoint {spec!r}: {where} ({task.task_id}) has no prompt")


def _check(setup: Any, spec: str) -> None:
    if not isinstance(setup, EnvSetup):
        raise EnvFactoryError(
            f"env.entrypoint {spec!r}: the factory returned a {type(setup).__name__}, expected an EnvSetup "
            "(components.contracts.environment)"
        )
    env = setup.env
    for attr in ("name", "success_threshold", "start"):
        if not hasattr(env, attr):
            raise EnvFactoryError(f"env.entrypoint {spec!r}: its environment has no {attr!r} (see Environment)")
    if not callable(setup.prompts) and not isinstance(setup.prompts, Sequence):
        raise EnvFactoryError(
            f"env.entrypoint {spec!r}: prompts is a {type(setup.prompts).__name__}; expected a task list or "
            "a function of the start index"
        )
    if not callable(setup.held_out) and not isinstance(setup.held_out, Sequence):
        raise EnvFactoryError(
            f"env.entrypoint {spec!r}: held_out is a {type(setup.held_out).__name__}; expected a task list or "
            "a function returning one"
        )
    for name in ("tools",):
        if not all(isinstance(t, dict) for t in getattr(setup, name)):
            raise EnvFactoryError(f"env.entrypoint {spec!r}: {name} must be a tuple of function-schema dicts")


def _normalised(setup: EnvSetup, spec: str, cfg: Config) -> EnvSetup:
    """The setup with `env.name` as its name, a task list cycled, and its first tasks checked."""
    prompts = setup.prompts
    if not callable(prompts):
        tasks = list(prompts)
        if not tasks:
            raise EnvFactoryError(f"env.entrypoint {spec!r}: the training set holds no tasks")
        for i, task in enumerate(tasks):
            _check_task(task, spec, f"training task {i}")
        prompts = functools.partial(cycled_prompts, tasks, cfg.train.task_seed)
    else:
        try:
            first = list(itertools.islice(prompts(0), CHECKED_TASKS))
        except EnvFactoryError:
            raise
        except Exception as exc:
            raise EnvFactoryError(f"env.entrypoint {spec!r}: its training stream failed: {exc}") from exc
        if not first:
            raise EnvFactoryError(f"env.entrypoint {spec!r}: the training stream yields no tasks")
        for i, item in enumerate(first):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)):
                raise EnvFactoryError(
                    f"env.entrypoint {spec!r}: the training stream must yield (index, Task) pairs, got "
                    f"{type(item).__name__} at position {i}"
                )
            _check_task(item[1], spec, f"training task {item[0]}")
    held_out = setup.held_out
    if not callable(held_out):
        held_list = list(held_out)
        for i, task in enumerate(held_list):
            _check_task(task, spec, f"held-out task {i}")
        held_out = functools.partial(list, held_list)
    else:
        held_out = _checked_held_out(held_out, spec)
    return dataclasses.replace(setup, name=cfg.env.name, prompts=prompts, held_out=held_out)


def _checked_held_out(load: Callable[[], list[Task]], spec: str) -> Callable[[], list[Task]]:
    """`load`, with what it returns checked when it is called (held-out sets load lazily)."""

    def checked() -> list[Task]:
        tasks = list(load())
        for i, task in enumerate(tasks):
            _check_task(task, spec, f"held-out task {i}")
        return tasks

    return checked


def load_env(cfg: Config, log: Callable[[str], None] = print) -> EnvSetup:
    """The environment's setup, checked, without the sandbox check (`build_env` adds it)."""
    spec = entrypoint_of(cfg)
    factory = load_factory(spec)
    setup = _call(factory, spec, dict(cfg.env.options), EnvContext(cfg, log))
    _check(setup, spec)
    return _normalised(setup, spec, cfg)


def build_env(cfg: Config, log: Callable[[str], None] = print) -> EnvSetup:
    """The environment `env.entrypoint` or `env.name` names, with its training stream, held-out set and step hook.
    One that runs model-written code checks the sandbox first (`sandbox_check.check_sandbox`): under
    `rollout.sandbox_degraded = "refuse"` a run on a host without the sandbox's namespaces stops here, before
    anything else starts; under "warn" it says so in `log`."""
    setup = load_env(cfg, log)
    if setup.sandboxed:
        check_sandbox(cfg.rollout.sandbox_degraded, cfg.rollout.tool_packages, log)
    return setup


def env_tools(cfg: Config) -> tuple[dict, ...]:
    """The tool schemas of the environment's episodes (see `EnvSetup.tools`)."""
    return load_env(cfg, lambda _: None).tools


def sft_traces(cfg: Config) -> list[Trace]:
    """The traces the environment's own (programmatic) teacher writes for SFT (see `EnvSetup.teacher`)."""
    setup = load_env(cfg)
    if setup.teacher is None:
        raise EnvFactoryError(
            f"distill.teacher: the environment {cfg.env.name!r} ({entrypoint_of(cfg)}) has no programmatic "
            "teacher; start RL from a policy you have (sao train --policy DIR), or distil traces from an endpoint "
            "(sao distill --teacher URL --teacher-model NAME: environments offering the Python tool alone)"
        )
    return setup.teacher()
