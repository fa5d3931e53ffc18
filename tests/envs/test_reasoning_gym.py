"""reasoning-gym task sets: the `reasoning-gym:` URI of `env.tasks` / `env.eval_tasks`, the tasks it makes (the
dataset's own entries), train and held-out sets that never share a question, and tir_math's reward from the
dataset's `score_answer`."""

from __future__ import annotations

import asyncio
import random

import pytest
import reasoning_gym

from components.chat.markers import parse_turn
from components.config import ConfigError
from components.config.reasoning_gym_uri import TaskSet, parse_task_set
from components.config.sections import EnvConfig
from components.contracts.markers import END
from components.data import reasoning_gym_tasks
from components.data.problem_sets import load_tasks
from components.data.reasoning_gym_tasks import split_of
from components.envs.tir_math import TIRMathEnvironment

TWO_DIGIT_SUMS = "min_terms=2&max_terms=2&min_digits=2&max_digits=2"
ONE_DIGIT_SUMS = "min_terms=2&max_terms=2&min_digits=1&max_digits=1"
"""chain_sum `a +/- b` with a, b in 0..9: 10 * 10 * 2 = 200 distinct questions, so any 2000 entries repeat them."""


def test_uri_values_parse_as_toml_and_bare_words():
    spec = parse_task_set(
        "reasoning-gym:basic_arithmetic?size=7&seed=3&operators=['+','*']&allow_parentheses=false"
        "&format_style=natural&min_terms=2"
    )
    assert spec == TaskSet(
        "basic_arithmetic",
        {"operators": ["+", "*"], "allow_parentheses": False, "format_style": "natural", "min_terms": 2},
        size=7,
        seed=3,
        split="train",
    )


def test_defaults_differ_by_split():
    # The held-out split defaults to its own seed, 10^6 away, and to 200 tasks.
    assert parse_task_set("reasoning-gym:chain_sum") == TaskSet("chain_sum", {}, 1000, 0, "train")
    assert parse_task_set("reasoning-gym:chain_sum?split=eval") == TaskSet("chain_sum", {}, 200, 1_000_000, "eval")


def test_config_names_the_split_of_each_field():
    train = f"reasoning-gym:chain_sum?size=50&seed=3&{TWO_DIGIT_SUMS}"
    # An empty held-out set beside a reasoning-gym training set: the same options held out, own seed and size.
    env = EnvConfig(tasks=train)
    assert (env.tasks, env.eval_tasks) == (train, f"reasoning-gym:chain_sum?{TWO_DIGIT_SUMS}&split=eval")
    # A held-out set given without a split draws from the held-out split.
    env = EnvConfig(tasks=train, eval_tasks="reasoning-gym:chain_sum?size=20")
    assert env.eval_tasks == "reasoning-gym:chain_sum?size=20&split=eval"
    # Files are untouched; a file training set leaves the built-in held-out set.
    assert (EnvConfig(tasks="p.jsonl").tasks, EnvConfig(tasks="p.jsonl").eval_tasks) == ("p.jsonl", "")


@pytest.mark.parametrize(
    "field, value, expected",
    [
        (
            "tasks",
            "reasoning-gym:chain_sums?size=5",
            "env.tasks: unknown reasoning-gym dataset 'chain_sums' (did you mean 'chain_sum'",
        ),
        (
            "tasks",
            "reasoning-gym:chain_sum?max_term=2",
            "env.tasks: reasoning-gym chain_sum: unknown option 'max_term' (did you mean 'max_terms'",
        ),
        (
            "tasks",
            "reasoning-gym:chain_sum?max_terms=two",
            "env.tasks: reasoning-gym chain_sum: option max_terms='two' does not fit <class 'int'>",
        ),
        ("tasks", "reasoning-gym:chain_sum?min_terms=3&max_terms=2", "max_terms must be >= min_terms"),
        ("tasks", "reasoning-gym:basic_arithmetic?format_style=natrual", "option format_style='natrual' does not fit"),
        ("tasks", "reasoning-gym:chain_sum?size=0", "env.tasks: size must be an integer >= 1, got 0"),
        ("tasks", "reasoning-gym:chain_sum?max_terms=2&max_terms=3", "env.tasks: 'max_terms' is given twice"),
        ("tasks", "reasoning-gym:chain_sum?max_terms", "env.tasks: expected key=value between '&'s, got 'max_terms'"),
        ("tasks", "reasoning-gym:chain_sum?split=eval", "env.tasks: split=eval in the training set"),
        ("eval_tasks", "reasoning-gym:chain_sum?split=train", "env.eval_tasks: split=train in the held-out set"),
        ("eval_tasks", "reasoning-gym:?size=5", "env.eval_tasks: 'reasoning-gym:?size=5&split=eval' names no dataset"),
    ],
)
def test_bad_names_and_options_are_one_error_naming_the_field(field, value, expected):
    with pytest.raises(ConfigError) as exc:
        EnvConfig(**{field: value})
    assert expected in str(exc.value)


def test_tasks_are_the_dataset_entries_of_that_seed():
    tasks = load_tasks(f"reasoning-gym:chain_sum?size=5&seed=3&{TWO_DIGIT_SUMS}")
    # Entry 0 of seed 3 by hand, as chain_sum draws it: rng = Random(3 + 0); 2 terms, 2 digits, each term
    # randint(10, 99), then the sign.
    rng = random.Random(3)
    assert (rng.randint(2, 2), rng.randint(2, 2)) == (2, 2)
    a, b, sign = rng.randint(10, 99), rng.randint(10, 99), rng.choice(["+", "-"])
    assert (a, b, sign) == (57, 87, "-")  # 57 - 87 = -30
    first = tasks[0]
    assert first.task_id == "chain_sum-3-0"
    assert first.prompt == "State the final answer to the following arithmetic problem: 57 - 87 ="
    assert first.answer == "-30"
    dataset = reasoning_gym.create_dataset(
        "chain_sum", seed=3, size=100, min_terms=2, max_terms=2, min_digits=2, max_digits=2
    )
    for task in tasks:
        record = task.metadata["reasoning_gym"]
        entry = dataset[record["index"]]
        assert task.task_id == f"chain_sum-3-{record['index']}"
        assert (task.prompt, task.answer, record["entry"]) == (entry["question"], entry["answer"], entry)
        assert split_of(task.prompt) == "train"
    # Entries whose question is held out are skipped, in index order: the indices rise.
    indices = [t.metadata["reasoning_gym"]["index"] for t in tasks]
    assert indices == sorted(indices) and len(tasks) == 5
    assert load_tasks(f"reasoning-gym:chain_sum?size=5&seed=3&{TWO_DIGIT_SUMS}", limit=2) == tasks[:2]


def test_train_and_held_out_never_share_a_question():
    # 200 distinct questions: seeds alone cannot keep 2000 training and 200 held-out entries apart (the two seeds'
    # entries share questions), the split does.
    train = load_tasks(f"reasoning-gym:chain_sum?size=2000&{ONE_DIGIT_SUMS}")
    held_out = load_tasks(f"reasoning-gym:chain_sum?size=200&split=eval&{ONE_DIGIT_SUMS}")
    raw = reasoning_gym.create_dataset(
        "chain_sum", seed=1_000_000, size=200, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    train_questions = {t.prompt for t in train}
    assert {e["question"] for e in raw} & train_questions  # what the seed alone would have given
    assert not {t.prompt for t in held_out} & train_questions
    assert {t.metadata["reasoning_gym"]["seed"] for t in held_out} == {1_000_000}
    # The same seed on both sides: still disjoint.
    same_seed = load_tasks(f"reasoning-gym:chain_sum?size=200&seed=0&split=eval&{ONE_DIGIT_SUMS}")
    assert not {t.prompt for t in same_seed} & train_questions


def test_a_split_without_enough_questions_is_an_error(monkeypatch):
    monkeypatch.setattr(reasoning_gym_tasks, "split_of", lambda question: "train")  # no question is held out
    with pytest.raises(ValueError, match=r"only 0 of the first \d+ entries are eval questions, fewer than size=5"):
        load_tasks("reasoning-gym:chain_sum?size=5&split=eval")


def _final(task, text: str):
    episode = TIRMathEnvironment().start(task)
    return asyncio.run(episode.step(parse_turn(text, False), False))


def test_tir_math_scores_with_the_dataset():
    task = load_tasks(f"reasoning-gym:chain_sum?size=1&seed=3&{TWO_DIGIT_SUMS}")[0]  # 57 - 87, answer "-30"
    right = _final(task, f"It is \\boxed{{-30}}{END}")
    assert (right.done, right.reward, right.info) == (True, 1.0, {"correct": True, "tool_calls": 0})
    assert _final(task, f"\\boxed{{30}}{END}").reward == 0.0
    assert _final(task, f"-30{END}").reward == 0.0  # no box, no answer
    # The dataset's own rules, not ours: it reads decimals ("-30.0" is -30) and gives partial credit to an answer
    # containing the reference ("-300": 3 of 4 characters), which is not solved (success_threshold 1.0).
    assert _final(task, f"\\boxed{{-30.0}}{END}").reward == 1.0
    partial = _final(task, f"\\boxed{{-300}}{END}")
    assert (partial.reward, partial.info["correct"]) == (0.75, False)
