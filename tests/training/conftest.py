"""Fixtures for the training tests: the tiny SFT policy as an HF directory, and run homes seeded with it."""

import shutil
from pathlib import Path

import pytest

from components.models import save_model_dir


@pytest.fixture(scope="session")
def sft_dir(sft_policy, tmp_path_factory):
    model, tokenizer = sft_policy
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("sft") / "policy")


@pytest.fixture(scope="session")
def grouped_trajectories(sft_policy):
    """Two prompts x 4 rollouts each, in group order (so GRPO has two groups), sampled at T = 1 by the SFT
    policy with real tool calls."""
    import asyncio
    import copy

    from components.agent.runner import AgentRunner, EpisodeLimits
    from components.data.tasks import make_problem
    from components.contracts.task import Task
    from components.envs.tir_math import TIRMathEnvironment
    from components.models import stop_token_ids
    from components.rollout.embedded import EmbeddedEngine

    model, tokenizer = sft_policy
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer).start()
    tasks = [Task(f"{pid}#g{g}", p.question, p.answer) for pid, p in
             (("a", make_problem("affine", (91, 87, 5), "a")), ("b", make_problem("affine", (13, 17, 40), "b")))
             for g in range(4)]
    runner = AgentRunner(engine, tokenizer, TIRMathEnvironment(), EpisodeLimits(temperature=1.0), concurrency=1,
                         stop_token_ids=tuple(stop_token_ids(tokenizer)))
    try:
        trajectories = asyncio.run(runner.run(tasks))
    finally:
        engine.shutdown()
    assert [t.prompt_id for t in trajectories] == [t.task_id for t in tasks]  # concurrency 1 keeps group order
    return trajectories


@pytest.fixture
def seeded_home(tmp_path: Path, sft_dir: Path) -> Path:
    """A run home whose SFT step reuses the test policy (saved with the preset's recipe) instead of training."""
    from components.config import load_config
    from components.jobs import sft_recipe
    from components.storage import atomic_dir, write_json

    home = tmp_path / "home"
    with atomic_dir(home / "models" / "sft-tir_math") as tmp:
        shutil.copytree(sft_dir, tmp, dirs_exist_ok=True)
        write_json(tmp / "sao_sft.json", {"recipe": sft_recipe(load_config("tiny-cpu"))})
    return home
