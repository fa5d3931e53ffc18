"""Environments chosen by config: training streams (bit-for-bit with the old trainer stream, resumable, cycled
sets), held-out sets, the style preference schedule, judge selection, and each environment's SFT teacher."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
from collections import Counter

import pytest

from components.chat import MarkerFormat, trace_segments
from components.chat.markers import parse_turn
from components.config import load_config
from components.contracts.environment import EnvSetup
from components.contracts.markers import END
from components.contracts.task import Task
from components.data.tasks import generate_problems
from components.data.traces import read_traces, write_traces
from components.envs.builtin import judge_from
from components.envs.coding import CodingEnvironment, solution_trace
from components.envs.latency import ToolLatency
from components.envs.registry import build_env, registered, sft_traces
from components.envs.style import STYLES, GradedJudge, LexicalJudge, LLMJudge
from components.envs.style_teacher import MAX_ANSWER_CHARS, PHRASES, style_answer, style_traces
from components.models import build_tokenizer


def config(*overrides: str):
    return load_config("tiny-cpu", list(overrides))


def take(setup: EnvSetup, start: int, group: int, n: int) -> list[Task]:
    return list(itertools.islice(setup.train_tasks(start, group), n))


def old_task_stream(cfg, start: int, group_size: int):
    """The trainer's `task_stream` before the registry, copied verbatim as the reference."""
    chunk = 4096
    for offset in itertools.count(start - start % chunk, chunk):
        problems = generate_problems(
            cfg.task.kinds, offset + chunk, cfg.train.task_seed, cfg.task.operand_max, "train"
        )[offset:]
        for index, p in enumerate(problems, start=offset):
            if index < start:
                continue
            for g in range(group_size):
                suffix = f"#g{g}" if group_size > 1 else ""
                yield Task(f"rl-{index}{suffix}", p.question, p.answer, {"kind": p.kind, "cursor": index})


def test_the_built_in_environments_are_registered_as_entry_points():
    assert registered() == {
        "tir_math": "components.envs.builtin:tir_math",
        "coding": "components.envs.builtin:coding",
        "style": "components.envs.builtin:style",
        "verifiers": "components.envs.verifiers_env:factory",  # any verifiers environment (env.options.module)
    }


@pytest.mark.parametrize("start, group", [(0, 1), (7, 4), (4094, 2), (4096, 1)])
def test_tir_math_stream_is_the_old_task_stream(start, group):
    # (4094, 2) crosses the 4096-problem chunk boundary; (4096, 1) starts exactly on it.
    cfg = config()
    setup = build_env(cfg)
    n = 6 * group
    assert take(setup, start, group, n) == list(itertools.islice(old_task_stream(cfg, start, group), n))


def test_tir_math_stream_known_head():
    tasks = take(build_env(config()), 0, 2, 3)
    assert [t.task_id for t in tasks] == ["rl-0#g0", "rl-0#g1", "rl-1#g0"]
    assert [t.metadata for t in tasks] == [{"kind": "affine", "cursor": 0}] * 2 + [{"kind": "affine", "cursor": 1}]
    first = generate_problems(("affine",), 1, 1, 99, "train")[0]  # train.task_seed = 1 in tiny-cpu
    assert (tasks[0].prompt, tasks[0].answer) == (first.question, first.answer)


def write_set(path, n: int) -> str:
    path.write_text("".join(json.dumps({"problem": f"Compute {i}+1.", "answer": i + 1}) + "\n" for i in range(n)))
    return str(path)


@pytest.mark.parametrize("overrides", [(), ('env.name="coding"',), ('env.name="style"',)])
@pytest.mark.parametrize("group", [1, 3])
def test_streams_resume_from_the_cursor(overrides, group):
    setup = build_env(config(*overrides))
    whole = take(setup, 0, group, 40 * group)
    for start in (1, 11, 12, 25):  # 12: exactly one epoch of the 12-task coding set
        assert take(setup, start, group, (40 - start) * group) == whole[start * group :]
        assert whole[start * group].metadata["cursor"] == start


def test_file_set_cycles_each_task_once_per_epoch_reshuffled(tmp_path):
    uri = write_set(tmp_path / "five.jsonl", 5)
    setup = build_env(config(f'env.tasks="{uri}"'))
    tasks = take(setup, 0, 1, 20)
    assert [t.task_id.split("@")[1] for t in tasks] == [str(i) for i in range(20)]  # `{task_id}@{index}`
    assert [t.metadata["cursor"] for t in tasks] == list(range(20))
    epochs = [[t.task_id.split("@")[0] for t in tasks[e * 5 : (e + 1) * 5]] for e in range(4)]
    assert all(sorted(e) == [f"five-{i}" for i in range(5)] for e in epochs)  # each task once per epoch
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch
    for t in tasks:  # prompt and answer travel with the id
        i = int(t.task_id.split("@")[0].split("-")[1])
        assert (t.prompt, t.answer) == (f"Compute {i}+1.", i + 1)
    assert take(build_env(config(f'env.tasks="{uri}"')), 0, 1, 20) == tasks  # deterministic
    other = take(build_env(config(f'env.tasks="{uri}"', "train.task_seed=2")), 0, 1, 20)
    assert [t.task_id for t in other] != [t.task_id for t in tasks]  # the order follows train.task_seed


def test_eval_tasks(tmp_path):
    cfg = config("task.eval_size=24")
    held_out = build_env(cfg).eval_tasks()
    expected = generate_problems(("affine",), 24, 0, 99, "eval")  # task.seed = 0: today's evaluation set
    assert [(t.task_id, t.prompt, t.answer) for t in held_out] == [
        (p.problem_id, p.question, p.answer) for p in expected
    ]
    train_questions = {t.prompt for t in take(build_env(cfg), 0, 1, 2000)}
    assert not train_questions & {t.prompt for t in held_out}
    uri = write_set(tmp_path / "held.jsonl", 3)
    assert [t.task_id for t in build_env(config(f'env.eval_tasks="{uri}"')).eval_tasks()] == [
        "held-0",
        "held-1",
        "held-2",
    ]
    coding = build_env(config('env.name="coding"'))
    assert [t.task_id for t in coding.eval_tasks()] == [t.task_id for t in coding.env.tasks]  # built-in: overlap
    assert len(build_env(config('env.name="style"')).eval_tasks()) == 20


def test_style_schedule_hand_worked():
    # cute:3,classical:2 has period 5: steps 0-2 cute, 3-4 classical, 5-7 cute, 8-9 classical, 10 cute.
    cfg = config('env.name="style"', 'env.preference_schedule="cute:3,classical:2"')
    setup = build_env(cfg)
    expected = ["cute"] * 3 + ["classical"] * 2 + ["cute"] * 3 + ["classical"] * 2 + ["cute"]
    messages = {}
    for step, style in enumerate(expected):
        metrics, message = setup.on_step(step)
        assert setup.env.preferred == style and metrics == {"env/preference": float(STYLES.index(style))}
        assert setup.env.start(Task("p", "Hi.")).preferred == style
        if message:
            messages[step] = message
    assert messages == {
        3: "env: preference cute -> classical at step 3",
        5: "env: preference classical -> cute at step 5",
        8: "env: preference cute -> classical at step 8",
        10: "env: preference classical -> cute at step 10",
    }
    # Stateless: a run resumed at a flip step still reports the flip; one resumed mid-phase does not.
    assert build_env(cfg).on_step(8)[1] == "env: preference cute -> classical at step 8"
    assert build_env(cfg).on_step(9) == ({"env/preference": 2.0}, None)


def test_empty_schedule_is_cute_throughout_and_other_envs_have_no_hook():
    style = build_env(config('env.name="style"'))
    assert style.env.preferred == "cute"
    assert [style.on_step(s) for s in (0, 1, 500)] == [({"env/preference": 0.0}, None)] * 3
    assert build_env(config()).on_step(3) == ({}, None)
    assert build_env(config('env.name="coding"')).on_step(0) == ({}, None)


def test_judge_selection():
    assert isinstance(build_env(config('env.name="style"')).env.judge, LexicalJudge)
    assert isinstance(build_env(config('env.name="style"', 'env.judge="graded"')).env.judge, GradedJudge)
    env = build_env(config('env.name="style"', 'env.judge="http://judge:8000/"', 'env.judge_model="qwen"')).env
    assert isinstance(env.judge, LLMJudge)
    assert (env.judge.url, env.judge.model) == ("http://judge:8000/v1/chat/completions", "qwen")
    with pytest.raises(ValueError, match="env.judge"):
        judge_from("ftp://judge", "qwen")
    with pytest.raises(ValueError, match="env.judge_model"):
        judge_from("https://judge", " ")


def test_tool_timeout_and_latency_from_config():
    cfg = config(
        'env.name="coding"',
        "rollout.tool_timeout_s=2.5",
        'rollout.latency="fixed"',
        "rollout.latency_mean_s=0.25",
        "task.seed=7",
    )
    env = build_env(cfg).env
    assert env.timeout_s == 2.5 and env.latency == ToolLatency("fixed", 0.25, cfg.rollout.latency_sigma, 7)
    tir = build_env(
        config(
            "rollout.tool_timeout_s=2.5",
            'rollout.latency="lognormal"',
            "rollout.latency_mean_s=1.0",
            "rollout.latency_sigma=0.5",
        )
    ).env
    assert tir.tool.timeout_s == 2.5 and tir.latency == ToolLatency("lognormal", 1.0, 0.5, 0)


def test_style_teacher_every_answer_scores_its_own_style():
    # Each phrase holds >= 1 marker of its style and none of another, and an answer has <= 10 words, so the
    # margin is >= 10 * 3 / 10 = 3: own score >= tanh(3 / 2) = 0.9051, any other style 0 (margin <= -3).
    judge = LexicalJudge()
    for style, (openers, middles, closers) in PHRASES.items():
        for parts in itertools.product(openers, middles, closers):
            answer = " ".join(parts)
            assert len(answer) <= MAX_ANSWER_CHARS and len(answer.split()) <= 10, answer
            assert judge.score_text(answer, style) >= math.tanh(1.5) - 1e-12, answer
            for other in STYLES:
                if other != style:
                    assert judge.score_text(answer, other) == 0.0, (answer, other)


def test_style_traces_mix_styles_uniformly():
    tasks = [Task(f"s{i}", f"Prompt {i}.") for i in range(4)]
    traces = style_traces(tasks, 3000, seed=5)
    assert traces == style_traces(tasks, 3000, seed=5) and traces != style_traces(tasks, 3000, seed=6)
    counts = Counter(t.problem_id.split("/")[1] for t in traces)
    assert set(counts) == set(STYLES) and all(900 <= c <= 1100 for c in counts.values())  # 1000 +- 3 sigma
    judge = LexicalJudge()
    for trace in traces[:300]:
        task_id, style, _ = trace.problem_id.split("/")
        assert trace.answer is None and trace.turns[0].content == f"Prompt {task_id[1:]}."
        assert judge.score_text(trace.turns[1].content, style) > 0.9
    with pytest.raises(ValueError, match="style"):
        style_answer("gothic", random.Random(0))


def test_coding_reference_solutions_pass_their_hidden_tests():
    cfg = config('env.name="coding"')
    env: CodingEnvironment = build_env(cfg).env
    traces = {t.problem_id: t for t in sft_traces(cfg)}
    assert set(traces) == {t.task_id for t in env.tasks}
    for task in env.tasks:  # the real sandbox, through the environment's own grading of a final turn
        answer = traces[task.task_id].turns[1].content
        result = asyncio.run(env.start(task).step(parse_turn(answer + END, False), False))
        assert (result.reward, result.info["passed"]) == (1.0, len(task.answer["tests"])), task.task_id
        assert "solution" not in task.metadata, "reference solutions must not reach trajectories"
    with pytest.raises(ValueError, match="task t: field 'solution'"):
        solution_trace(Task("t", "Write add.", {"entry_point": "add", "tests": ["assert add(1, 1) == 2"]}))


BUDGETS = {"tir_math": 48, "style": 48, "coding": 128}
"""task.max_new_tokens each environment's teacher needs (char tokenizer): tir_math and style fit the tiny
preset's 48; coding's longest reference (fibonacci) takes 108 tokens."""


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_sft_traces_fit_the_turn_budget(name, tmp_path):
    cfg = config(f'env.name="{name}"', "task.train_size=300", f"task.max_new_tokens={BUDGETS[name]}")
    tokenizer = build_tokenizer()
    traces = sft_traces(cfg)
    assert len(traces) == (12 if name == "coding" else 300)
    longest = 0
    for trace in traces:
        segments = trace_segments(MarkerFormat(tokenizer), trace)
        for text, is_action in segments:
            if is_action:
                longest = max(longest, len(tokenizer(text, add_special_tokens=False)["input_ids"]))
        total = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text, _ in segments)
        assert total <= cfg.rollout.max_total_tokens, trace.problem_id
    assert longest <= cfg.task.max_new_tokens
    if name == "coding":
        assert longest > 48  # the tiny preset's 48 is too small for coding: it needs an override
    assert read_traces(write_traces(tmp_path / "t.parquet", traces)) == traces  # None answers round-trip
