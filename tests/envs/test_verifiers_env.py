"""verifiers environments under SAO (issue 43): the test environments `vf_calculator` (a ToolEnv) and `vf_guess`
(a MultiTurnEnv), written against verifiers' own contract, load through the registry (`env.entrypoint` and
`[env.options]`), run in the real agent runner against the embedded engine, and train with the real trainer."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import textwrap
import threading
from dataclasses import replace

import pytest
import torch

from components.agent.runner import AgentRunner, episode_limits
from components.chat import HermesFormat, MarkerFormat
from components.chat.markers import parse_turn
from components.config import load_config
from components.contracts.chat import ModelTurn, ToolCall
from components.contracts.markers import observation_text, prompt_text
from components.envs.registry import EnvFactoryError, build_env
from components.models import token_logprobs
from components.tracking import NullTracker
from components.training.rl.trainer import train
from tests.envs import vf_calculator
from tests.factories import segments

ENTRYPOINT = "components.envs.verifiers_env:factory"


def vf_config(module: str = "tests.envs.vf_calculator", *overrides: str):
    return load_config(
        "tiny-cpu",
        [f'env.entrypoint="{ENTRYPOINT}"', 'env.name="calculator"', f'env.options.module="{module}"', *overrides],
    )


@pytest.fixture(scope="module")
def calculator():
    """The calculator environment's setup: 16 training rows, 8 eval rows."""
    return build_env(vf_config("tests.envs.vf_calculator", "env.options.args.num_train=16"), log=lambda _: None)


def calculator_output(code: str) -> str:
    """What verifiers' ToolEnv answers a call of the calculator with: its output, or its error's text."""
    try:
        return vf_calculator.python(code)
    except Exception as exc:  # ToolEnv.env_response's error_formatter: f"{e}"
        return f"{exc}"


def expected_reward(tokenizer, trajectory, answer: str) -> tuple[float, int]:
    """The rubric's reward re-computed from the trajectory's own tokens, and its number of tool calls:
    1.0 * (boxed answer after a call) + 0.25 * (a call), for an episode verifiers ended; 0 when the runner's
    limits ended it."""
    runs = segments(trajectory)
    actions = [tokenizer.decode(ids) for m, ids in runs if m == 1]
    calls = sum(parse_turn(a, False).call is not None for a in actions)
    if trajectory.finish_reason not in ("stop", "length", "max_turns"):
        return 0.0, calls
    final = parse_turn(actions[-1], trajectory.finish_reason == "length")
    boxed = re.findall(r"\\boxed\{(-?\d+)\}", final.content) if final.call is None else []
    correct = calls > 0 and bool(boxed) and boxed[-1] == answer
    return vf_calculator.WEIGHTS[0] * correct + vf_calculator.WEIGHTS[1] * (calls > 0), calls


def check_trajectory(tokenizer, trajectory, task) -> int:
    """The invariants of a calculator trajectory; returns its number of tool calls."""
    runs = segments(trajectory)
    # The prompt (the marker format drops the system prompt and implies the python tool), then actions and
    # observations; each observation is exactly the environment's answer to the call before it.
    assert runs[0] == (0, runs[0][1]) and tokenizer.decode(runs[0][1]) == prompt_text(task.prompt)
    for (_, before), (is_action, ids) in zip(runs[1:], runs[2:]):
        if not is_action:
            code = parse_turn(tokenizer.decode(before), False).call.arguments["code"]
            assert tokenizer.decode(ids) == observation_text(calculator_output(code))
    # Observation and prompt tokens are masked, with no log-prob or version; every action token has both.
    for m, lp, v in zip(trajectory.action_mask, trajectory.rollout_logprobs, trajectory.versions):
        assert (lp is not None and v is not None) if m else (lp is None and v is None)
    reward, calls = expected_reward(tokenizer, trajectory, task.answer)
    assert trajectory.reward == pytest.approx(reward)
    if trajectory.finish_reason in ("stop", "length", "max_turns"):  # verifiers scored it: its metrics are kept
        metrics = trajectory.metadata["vf_metrics"]
        assert metrics["total_tool_calls"] == calls and metrics["used_calculator"] == float(calls > 0)
    return calls


def test_a_tool_env_runs_in_the_agent_runner_with_masked_observations_and_the_engines_logprobs(
    engine, sft_policy, calculator
):
    model, tokenizer = sft_policy
    cfg = vf_config()
    tasks = [t for _, t in zip(range(12), calculator.train_tasks(0, 1))]
    runner = AgentRunner(engine, MarkerFormat(tokenizer), calculator.env, episode_limits(cfg), 6)
    trajectories = asyncio.run(runner.run(tasks))
    by_id = {t.task_id: t for t in tasks}
    assert sorted(t.prompt_id for t in trajectories) == sorted(by_id)
    calls = [check_trajectory(tokenizer, t, by_id[t.prompt_id]) for t in trajectories]
    assert min(calls) >= 1, f"every episode calls the calculator at least once: {calls}"
    assert {t.metadata["stop_condition"] for t in trajectories} <= {"no_tools_called", "max_turns_reached"}
    for t in trajectories:
        # The rollout log-probs are the policy's own, teacher-forced at the rollout temperature.
        lp = token_logprobs(model, torch.tensor([t.token_ids]), cfg.algo.temperature)[0]
        mask = torch.tensor(t.action_mask, dtype=torch.bool)
        logged = torch.tensor([x if x is not None else 0.0 for x in t.rollout_logprobs])
        torch.testing.assert_close(logged[mask], lp[mask], atol=1e-4, rtol=0)
        assert set(v for v in t.versions if v is not None) == {0}


def test_sao_trains_on_a_verifiers_tool_env(tmp_path, tiny_cfg, sft_dir):
    """Three SAO steps from the SFT policy on the calculator environment; every trajectory the trainer trained on
    holds the invariants above, with versions from the policy's updates."""
    from components.models import build_tokenizer

    base = vf_config("tests.envs.vf_calculator", "env.options.args.num_train=32")
    cfg = replace(
        base,
        train=replace(base.train, backend="torch", batch_size=4, max_steps=3, checkpoint_every=0, collapse_guard="off"),
        rollout=replace(base.rollout, concurrency=4),
    )
    setup = build_env(cfg, log=lambda _: None)
    rows = {t.task_id: t for t in setup.env.train_tasks()}
    trained = []
    result = train(cfg, setup, sft_dir, tmp_path, NullTracker(), log=lambda _: None,
                   on_step=[lambda trainer, batch, row: trained.append((batch, row))])  # fmt: skip
    assert result.version == 3 and len(trained) == 3
    tokenizer = build_tokenizer()
    for step, (batch, row) in enumerate(trained, start=1):
        assert len(batch) == 4 and row["reward/mean"] == pytest.approx(sum(t.reward for t in batch) / 4)
        for t in batch:
            calls = check_trajectory(tokenizer, t, rows[t.prompt_id.split("@")[0]])
            assert calls >= 1
            assert all(0 <= v < step for v in t.versions if v is not None)  # sampled by versions before this step
    assert any(v > 0 for batch, _ in trained[1:] for t in batch for v in t.versions if v is not None)


def test_the_models_own_chat_template_renders_the_rollout_verifiers_recorded(calculator):
    """Under a Hermes (Qwen3) template the prompt carries the environment's system prompt and tool schema, and the
    episode's pieces (prompt, sampled turns, observations) are the template's render of the conversation verifiers
    recorded, up to the template's newline after the last turn."""
    from components.models.qwen_vocab import qwen3_tokenizer

    chat = HermesFormat(qwen3_tokenizer())
    task = calculator.eval_tasks()[0]
    episode = calculator.env.start(task)
    prompt = episode.prompt()
    assert prompt.system == vf_calculator.SYSTEM_PROMPT and prompt.tools == calculator.tools
    assert [t["function"]["name"] for t in prompt.tools] == ["python"]
    expression = task.prompt.removeprefix("Compute ").removesuffix(".")
    call = f'<tool_call>\n{{"name": "python", "arguments": {{"code": "print({expression})"}}}}\n</tool_call><|im_end|>'
    answer = f"So \\boxed{{{task.answer}}}.<|im_end|>"

    async def play():
        first = await episode.step(chat.parse(call, False), False)
        last = await episode.step(chat.parse(answer, False), False)
        return first, last

    first, last = asyncio.run(play())
    assert first.observation == f"{task.answer}\n" and not first.done
    assert last.done and last.reward == 1.25 and last.finish_reason == "stop"
    text = chat.prompt_text(prompt) + call + chat.observation_text(first.observation) + answer
    conversation = [message(m) for m in episode.state["prompt"] + episode.state["completion"]]
    assert chat.render(conversation, prompt.tools) == text + "\n"


def message(m) -> dict:
    """A verifiers message as the OpenAI-style dict a chat template takes (arguments as a JSON object)."""
    import json

    out = m.model_dump(exclude_none=True)
    calls = out.pop("tool_calls", None)
    if calls:
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c["name"], "arguments": json.loads(c["arguments"])}}
            for c in calls
        ]
    return out


def turn(text: str) -> ModelTurn:
    return ModelTurn(text, text, ended=True)


def test_a_multi_turn_env_answers_with_env_response_and_ends_on_its_stop_condition():
    setup = build_env(vf_config("tests.envs.vf_guess"), log=lambda _: None)
    assert setup.tools == () and [t.answer for t in setup.env.train_tasks()] == ["3", "7"]

    async def play(task, guesses):
        episode = setup.env.start(task)
        return [await episode.step(turn(f"I guess {g}."), False) for g in guesses]

    three, seven = setup.env.train_tasks()
    steps = asyncio.run(play(three, [5, 1, 3]))
    # env_response's user messages are the observations; the environment's `guessed` stop condition ends it, and
    # the rubric's 1 / guesses is the reward.
    assert [s.observation for s in steps] == ["lower", "higher", None]
    assert steps[-1].done and steps[-1].finish_reason == "stop" and steps[-1].reward == pytest.approx(1 / 3)
    assert steps[-1].info["stop_condition"] == "guessed"
    steps = asyncio.run(play(seven, [1, 2, 3, 4, 5]))  # max_turns = 5: verifiers' max_turns_reached
    assert [s.observation for s in steps[:4]] == ["higher"] * 4
    assert steps[-1].done and steps[-1].finish_reason == "max_turns" and steps[-1].reward == 0.0


def test_malformed_calls_go_the_environments_way_or_end_the_episode(calculator):
    task = calculator.eval_tasks()[0]

    async def play(env, *turns):
        episode = env.start(task)
        return [await episode.step(t, False) for t in turns]

    # A call with an unknown argument reaches the tool, whose error verifiers returns as the tool's message.
    bad_args = ModelTurn("", "", call=ToolCall("python", {"cmd": "print(1)"}))
    step = asyncio.run(play(calculator.env, bad_args))[0]
    assert step.malformed and not step.done and "unexpected keyword argument 'cmd'" in step.observation
    # A call the format could not parse is prose to verifiers (as vLLM's parser leaves it): the ToolEnv ends.
    unparsed = ModelTurn("<tool_call>{", "", call_error="the tool call has no closing </tool_call>")
    step = asyncio.run(play(calculator.env, unparsed))[0]
    assert step.malformed and step.done and step.finish_reason == "stop" and step.reward == 0.0
    assert step.info["stop_condition"] == "no_tools_called"
    # env.malformed_calls = "end" ends such an episode unrewarded, as for the built-in environments.
    ending = build_env(vf_config("tests.envs.vf_calculator", 'env.malformed_calls="end"'), log=lambda _: None)
    step = asyncio.run(play(ending.env, bad_args))[0]
    assert step.malformed and step.done and step.finish_reason == "malformed_call" and step.reward == 0.0


def test_held_out_sets_the_eval_dataset_or_rows_split_off(calculator):
    train_ids = {t.task_id for t in calculator.env.train_tasks()}
    held = calculator.eval_tasks()
    assert len(train_ids) == 16 and len(held) == 8 and all(t.task_id.startswith("eval-") for t in held)
    assert calculator.env.success_threshold == 1.0  # the environment's pass_threshold
    split = build_env(
        vf_config("tests.envs.vf_calculator", "env.options.args.num_eval=0", "env.options.args.num_train=12",
                  "env.options.held_out_size=4", "env.options.success_threshold=1.25"),
        log=lambda _: None,
    )  # fmt: skip
    train_ids, held_ids = {t.task_id for t in split.env.train_tasks()}, {t.task_id for t in split.eval_tasks()}
    assert len(train_ids) == 8 and held_ids == {f"train-{i}" for i in range(8, 12)}
    assert split.env.success_threshold == 1.25


def test_loading_keeps_the_processs_signal_handlers_and_works_off_the_main_thread():
    def handler(signum, frame):
        return None

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        errors = []
        thread = threading.Thread(target=lambda: _load_into(errors))
        thread.start()
        thread.join()
        assert errors == [None]
        build_env(vf_config(), log=lambda _: None)
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def _load_into(errors: list) -> None:
    try:
        build_env(vf_config(), log=lambda _: None)
        errors.append(None)
    except Exception as exc:
        errors.append(exc)


@pytest.fixture
def outside(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def write_module(directory, name: str, code: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(code))
    sys.modules.pop(name, None)


FEW_SHOT = """
    import verifiers as vf
    from datasets import Dataset

    def load_environment():
        shots = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
        rows = [{"question": "2+2?", "answer": "4"}]
        return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), few_shot=shots, rubric=vf.Rubric(funcs=[]))
"""
GROUP = """
    import verifiers as vf
    from datasets import Dataset

    async def rank(states, **kwargs):
        return [1.0 for _ in states]

    def load_environment():
        rows = [{"question": "2+2?", "answer": "4"}]
        return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[rank]))
"""
BAD = {
    "missing module": (None, ["env.options.module='no_such_vf_env'"], "cannot import the verifiers environment"),
    "no load_environment": ("x = 1\n", [], "has no load_environment(**kwargs)"),
    "not an environment": ("def load_environment():\n    return {'dataset': []}\n", [], "returned a dict"),
    "few-shot prompt": (FEW_SHOT, [], "got roles ['user', 'assistant', 'user'] (few-shot turns"),
    "group rubric": (GROUP, [], "group-level reward functions"),
    "unknown option": (None, ["env.options.modul='x'"], "unknown key(s) ['modul']"),
    "env.tasks": (None, ["env.tasks='tasks.jsonl'"], "a verifiers environment brings its own datasets"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_error_naming_the_entry_point(case, outside):
    code, overrides, message = BAD[case]
    if code is not None:
        write_module(outside, "bad_vf_env", code)
    cfg = vf_config("bad_vf_env", *overrides)
    with pytest.raises(EnvFactoryError) as info:
        build_env(cfg, log=lambda _: None)
    assert str(info.value).startswith(f"env.entrypoint {ENTRYPOINT!r}: ") and message in str(info.value)


def test_env_name_verifiers_is_the_registered_entry_point():
    cfg = load_config("tiny-cpu", ['env.name="verifiers"', 'env.options.module="tests.envs.vf_guess"'])
    setup = build_env(cfg, log=lambda _: None)
    assert setup.name == "verifiers" and len(setup.env.train_tasks()) == 2
