"""Agent runner on real episodes of the tiny SFT policy through the embedded engine."""

import asyncio
import copy
import time

import pytest
import torch

from components.agent.runner import AgentRunner, EpisodeLimits
from components.chat import MarkerFormat
from components.chat.markers import parse_turn
from components.contracts.markers import observation_text, prompt_text
from components.contracts.trajectory import read_trajectories, to_tensors, write_trajectories
from components.data.tasks import generate_problems, make_problem
from components.envs.grading import grade_answer
from components.envs.latency import ToolLatency
from components.envs.python_tool import PythonTool
from components.envs.tir_math import TIRMathEnvironment, tasks_from_problems
from components.models import token_logprobs
from components.rollout.client import EngineClient
from components.rollout.embedded import EmbeddedEngine
from components.rollout.server import ServerThread, create_app
from tests.factories import segments


def test_trajectory_invariants_on_real_runs(engine, sft_policy, tmp_path):
    model, tokenizer = sft_policy
    tasks = tasks_from_problems(generate_problems(("affine",), 16, 0, 99, "eval"))
    runner = AgentRunner(engine, MarkerFormat(tokenizer), TIRMathEnvironment(), EpisodeLimits(temperature=1.0), 8)
    trajectories = asyncio.run(runner.run(tasks))
    assert sorted(t.prompt_id for t in trajectories) == sorted(t.task_id for t in tasks)
    by_id = {t.task_id: t for t in tasks}
    with_tools = 0
    for traj in trajectories:
        task = by_id[traj.prompt_id]
        runs = segments(traj)
        # The prompt, then actions and observations; decoding each run reproduces what the episode exchanged.
        assert tokenizer.decode(runs[0][1]) == prompt_text(task.prompt) and runs[0][0] == 0
        for (_, prev), (is_action, ids) in zip(runs[1:], runs[2:]):
            if not is_action:  # an observation is exactly the sandbox's answer to the preceding tool call
                with_tools += 1
                code = parse_turn(tokenizer.decode(prev), False).call.arguments["code"]
                assert tokenizer.decode(ids) == observation_text(PythonTool()(code))
        # Observations carry no log-prob or version; every action token carries both.
        for m, lp, v in zip(traj.action_mask, traj.rollout_logprobs, traj.versions):
            assert (lp is not None and v == 0) if m else (lp is None and v is None)
        # The reward matches re-grading the final answer.
        final_turn = tokenizer.decode(runs[-1][1])
        if traj.finish_reason == "stop":
            assert traj.reward == float(grade_answer(final_turn, task.answer) and final_turn.endswith("<|end|>"))
        # Rollout log-probs are the policy's, teacher-forced at the rollout temperature.
        lp = token_logprobs(model, torch.tensor([traj.token_ids]), 1.0)[0]
        mask = torch.tensor(traj.action_mask, dtype=torch.bool)
        logged = torch.tensor([x if x is not None else 0.0 for x in traj.rollout_logprobs])
        torch.testing.assert_close(logged[mask], lp[mask], atol=1e-4, rtol=0)
    assert with_tools > 0
    path = write_trajectories(tmp_path / "t.parquet", trajectories)
    assert [t.token_ids for t in read_trajectories(path)] == [t.token_ids for t in trajectories]
    batch = to_tensors(trajectories, tokenizer.pad_token_id)
    for row, traj in enumerate(trajectories):
        assert batch["rewards"][row].sum() == traj.reward
        if traj.num_actions:
            assert batch["rewards"][row, traj.reward_position()] == traj.reward


def test_heavy_tailed_tools_hand_over_out_of_order_without_waiting(engine, sft_policy):
    # Greedy decoding of large products always calls the tool; each call waits a lognormal delay (seeded per
    # episode, mean 0.4 s, sigma 1.5: a few stragglers take seconds).
    model, tokenizer = sft_policy
    problems = [make_problem("affine", (91 - i, 87 - i, 5 + i), f"p{i}") for i in range(12)]
    latency = ToolLatency("lognormal", mean_s=0.4, sigma=1.5, seed=3)
    runner = AgentRunner(
        engine, MarkerFormat(tokenizer), TIRMathEnvironment(latency=latency), EpisodeLimits(temperature=0), 4
    )
    delivered, trajectories = [], []

    def sink(trajectory):
        delivered.append((trajectory.prompt_id, time.time(), runner.in_flight))
        trajectories.append(trajectory)

    assert asyncio.run(runner.run(tasks_from_problems(problems), sink)) == []  # the sink owns them
    assert runner.max_in_flight == 4
    order = [pid for pid, _, _ in delivered]
    assert order != [p.problem_id for p in problems]  # handed over as finished, not in submission order
    finished = {t.prompt_id: t.timings.finished for t in trajectories}
    for pid, at, _ in delivered:
        assert at - finished[pid] < 0.05  # handed over at once
    slowest = max(trajectories, key=lambda t: t.timings.finished - t.timings.started)
    early = [pid for pid, at, in_flight in delivered if at < slowest.timings.finished and in_flight > 0]
    assert len(early) >= 3, "trajectories were handed over while the straggler was still running"


def test_engine_errors_and_timeouts_are_recorded_not_dropped(engine, sft_policy):
    model, tokenizer = sft_policy
    tasks = tasks_from_problems([make_problem("affine", (91, 87, 5), "slow"), make_problem("affine", (93, 86, 4), "x")])
    chat = MarkerFormat(tokenizer)

    async def dead_engine():
        async with EngineClient("http://127.0.0.1:9", retries=0, timeout_s=2) as client:
            return await AgentRunner(client, chat, TIRMathEnvironment()).run(tasks)

    for traj in asyncio.run(dead_engine()):
        assert traj.finish_reason == "engine_error" and "ConnectError" in traj.metadata["error"]
        assert traj.num_actions == 0 and traj.reward == 0.0
    slow_tools = TIRMathEnvironment(latency=ToolLatency("fixed", mean_s=30.0))
    runner = AgentRunner(engine, chat, slow_tools, EpisodeLimits(temperature=0, max_wall_s=1.0))
    start = time.monotonic()
    trajectories = asyncio.run(runner.run(tasks))
    assert time.monotonic() - start < 10
    assert [t.finish_reason for t in trajectories] == ["timeout", "timeout"]
    assert all(t.num_actions > 0 for t in trajectories)  # the tool call that was cut off is kept


def test_runner_over_http_and_turn_limits(sft_policy):
    model, tokenizer = sft_policy
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer).start()
    tasks = tasks_from_problems([make_problem("affine", (91, 87, 5), "a")])
    try:
        with ServerThread(create_app(engine, "tiny")) as url:

            async def go(limits):
                async with EngineClient(url) as client:
                    runner = AgentRunner(client, MarkerFormat(tokenizer), TIRMathEnvironment(), limits)
                    return (await runner.run(tasks))[0]

            full = asyncio.run(go(EpisodeLimits(temperature=0)))
            one_turn = asyncio.run(go(EpisodeLimits(temperature=0, max_turns=1)))
            few_tokens = asyncio.run(go(EpisodeLimits(temperature=0, max_new_tokens=5)))
    finally:
        engine.shutdown()
    assert full.finish_reason == "stop" and full.turns == 2
    assert one_turn.finish_reason == "max_turns" and one_turn.turns == 1
    assert few_tokens.finish_reason == "length" and few_tokens.num_actions == 5


def test_every_engine_down_stops_the_run_even_while_admission_waits():
    """`EnginesDown` is the run's failure, not an episode's: `run` starts nothing more and raises it, also when
    it is waiting for admission that only finished episodes (none will come) could grant."""
    from components.models import build_tokenizer
    from components.rollout.pool import EnginesDown

    tokenizer = build_tokenizer()
    calls, sunk = [], []

    class Down:  # every server of the pool stayed down past its wait
        async def generate(self, request):
            calls.append(request)
            await asyncio.sleep(0.05)
            raise EnginesDown("every engine server is down: waited 3.0 s for one to come back")

    started = []

    async def admit(task):  # two starts, then closed for good (the trainer never gets a batch)
        if len(started) == 2:
            await asyncio.Event().wait()
        started.append(task.task_id)

    def endless():  # a training task stream
        i = 0
        while True:
            i += 1
            yield from tasks_from_problems([make_problem("affine", (i, 3, 4), f"t{i}")])

    async def run():
        runner = AgentRunner(Down(), MarkerFormat(tokenizer), TIRMathEnvironment(), concurrency=4)
        return await asyncio.wait_for(runner.run(endless(), sunk.append, admit), 10)

    with pytest.raises(EnginesDown, match="waited 3.0 s"):
        asyncio.run(run())
    assert len(started) == 2 and len(calls) == 2 and sunk == []  # each admitted episode asked once, none kept
