"""Evaluation on the episode path: accuracy, avg@k and pass@k counted by hand, greedy determinism, real tools."""

import math

import pytest

from components.agent.runner import EpisodeLimits
from components.chat import MarkerFormat
from components.contracts.markers import CALL, CALL_END, OUTPUT, OUTPUT_END
from components.contracts.trajectory import Timings, Trajectory
from components.data.tasks import generate_problems
from components.envs.tir_math import TIRMathEnvironment, tasks_from_problems
from components.eval.evaluate import evaluate, score
from components.sandbox.run import run_python


def _trajectory(task_id: str, reward: float) -> Trajectory:
    return Trajectory(task_id, "tir_math", [5, 6], [0, 1], [None, -0.5], [None, 0], reward, 1, "stop", 1, Timings(0.0))


def test_scores_by_hand():
    # Three tasks, K = 2.
    #   greedy:  [0, 1, 0]             -> accuracy 1/3
    #   samples: [[1, 1], [0, 1], [0, 0]] -> avg@2 = (2/2 + 1/2 + 0/2) / 3 = 1/2; pass@2 = (1 + 1 + 0) / 3 = 2/3
    greedy = [_trajectory(f"t{i}", r) for i, r in enumerate([0.0, 1.0, 0.0])]
    sampled = [
        [_trajectory(f"t{i}#s{k}", r) for k, r in enumerate(rs)]
        for i, rs in enumerate([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    ]
    assert score(greedy, sampled, 1.0) == pytest.approx((1 / 3, 1 / 2, 2 / 3))
    # The threshold decides success: with 0.5, a reward of 0.6 counts, 0.4 does not.
    # greedy [0.6, 0.4] -> 1/2; samples [[0.4], [0.6]] -> avg@1 = pass@1 = 1/2
    assert score(
        [_trajectory("a", 0.6), _trajectory("b", 0.4)], [[_trajectory("a", 0.4)], [_trajectory("b", 0.6)]], 0.5
    ) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="same number K"):
        score(greedy, [[greedy[0]], [], [greedy[2]]], 1.0)


def test_evaluate_counts_what_the_trajectories_show(engine, sft_policy):
    _, tokenizer = sft_policy
    tasks = tasks_from_problems(generate_problems(("affine",), 12, 0, 99, "eval"))
    limits = EpisodeLimits(max_turns=3, max_new_tokens=40, max_total_tokens=400, temperature=1.0)
    env = TIRMathEnvironment()
    report = evaluate(
        engine,
        MarkerFormat(tokenizer),
        env,
        tasks,
        limits,
        samples=3,
        concurrency=16,
    )
    assert report.n == 12 and report.samples == 3
    assert [t.prompt_id for t in report.greedy] == [t.task_id for t in tasks]
    assert [[t.prompt_id for t in s] for s in report.sampled] == [
        [f"{t.task_id}#s{k}" for k in range(3)] for t in tasks
    ]
    # The hand count over the returned trajectories: a solved episode is one the grader marked correct.
    solved = [[bool(t.metadata.get("correct")) for t in s] for s in report.sampled]
    assert report.accuracy == sum(bool(t.metadata.get("correct")) for t in report.greedy) / 12
    assert report.avg_at_k == pytest.approx(sum(sum(s) / 3 for s in solved) / 12)
    assert report.pass_at_k == sum(any(s) for s in solved) / 12
    assert report.accuracy > 0.25, "200 SFT steps already solve some problems"
    assert sum(report.finish_reasons.values()) == 12
    # Every observation is what the sandbox prints for the preceding call: the tools really ran.
    for t in report.greedy:
        text = tokenizer.decode(t.token_ids)
        for before, after in zip(text.split(OUTPUT), text.split(OUTPUT)[1:]):
            code = before[before.rfind(CALL) + len(CALL) : before.rfind(CALL_END)]
            assert after.split(OUTPUT_END)[0] == run_python(code).stdout or "Error" in after
        assert all(math.isfinite(lp) for lp in t.rollout_logprobs if lp is not None)
    # Greedy is deterministic: the same tasks again give the same tokens.
    again = evaluate(
        engine,
        MarkerFormat(tokenizer),
        env,
        tasks[:4],
        limits,
        samples=1,
        concurrency=4,
    )
    assert [t.token_ids for t in again.greedy] == [t.token_ids for t in report.greedy[:4]]
    assert again.avg_at_k == again.pass_at_k == again.accuracy


def test_evaluate_rejects_bad_input(engine, sft_policy):
    _, tokenizer = sft_policy
    task = tasks_from_problems(generate_problems(("affine",), 1, 0, 99, "eval"))[0]
    with pytest.raises(ValueError, match="samples"):
        evaluate(engine, MarkerFormat(tokenizer), TIRMathEnvironment(), [task], EpisodeLimits(), samples=0)
    with pytest.raises(ValueError, match="unique"):
        evaluate(engine, MarkerFormat(tokenizer), TIRMathEnvironment(), [task, task], EpisodeLimits())
