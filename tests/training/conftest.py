"""Fixtures for the training tests: trajectories sampled by the tiny SFT policy."""

import pytest


@pytest.fixture(scope="session")
def grouped_trajectories(sft_policy):
    """Two prompts x 4 rollouts each, in group order (so GRPO has two groups), sampled at T = 1 by the SFT
    policy with real tool calls."""
    import asyncio
    import copy

    from components.agent.runner import AgentRunner, EpisodeLimits
    from components.chat import MarkerFormat
    from components.contracts.task import Task
    from components.data.tasks import make_problem
    from components.envs.tir_math import TIRMathEnvironment
    from components.rollout.embedded import EmbeddedEngine

    model, tokenizer = sft_policy
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer).start()
    tasks = [
        Task(f"{pid}#g{g}", p.question, p.answer)
        for pid, p in (
            ("a", make_problem("affine", (91, 87, 5), "a")),
            ("b", make_problem("affine", (13, 17, 40), "b")),
        )
        for g in range(4)
    ]
    runner = AgentRunner(engine, MarkerFormat(tokenizer), TIRMathEnvironment(), EpisodeLimits(temperature=1.0), 1)
    try:
        trajectories = asyncio.run(runner.run(tasks))
    finally:
        engine.shutdown()
    assert [t.prompt_id for t in trajectories] == [t.task_id for t in tasks]  # concurrency 1 keeps group order
    return trajectories
