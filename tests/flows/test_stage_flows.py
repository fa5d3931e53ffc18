"""The stage flows one by one under the session's Prefect harness, and their task logic through `.fn()`."""

import copy
import dataclasses

import pytest

from components.config import load_config
from components.contracts.trace import Trace, Turn
from components.data.tasks import generate_problems
from components.data.teacher import teacher_trace
from components.data.traces import read_traces, write_traces

FAST = [
    "sft.steps=20",
    "sft.batch_size=16",
    "sft.warmup_steps=2",
    "task.eval_size=4",
    "train.batch_size=4",
    "rollout.concurrency=4",
    'train.backend="torch"',
    'tracking.backend="disk"',
]


def _traces(n: int) -> list[Trace]:
    return [teacher_trace(p) for p in generate_problems(("affine",), n, 0, 99, "train")]


def test_the_gate_flow_passes_good_traces_and_fails_bad_ones_with_a_readable_report(tmp_path, prefect_api):
    from components.data.gates import GateFailed
    from flows.gate import gate

    good = write_traces(tmp_path / "good.parquet", _traces(6))
    assert gate(str(good), "traces", home=str(tmp_path))["row_count"] == 6
    traces = _traces(6)
    wrong = traces[2]  # its boxed answer is off by one: the answer expectation names it
    traces[2] = Trace(
        wrong.problem_id, wrong.turns[:-1] + (Turn("assistant", f"\\boxed{{{wrong.answer + 1}}}"),), wrong.answer
    )
    traces[4] = Trace(traces[1].problem_id, traces[4].turns, traces[4].answer)  # a duplicate id
    bad = write_traces(tmp_path / "bad.parquet", traces)
    with pytest.raises(GateFailed) as failed:
        gate(str(bad), "traces", home=str(tmp_path))
    message = str(failed.value)
    # Each failing expectation with its column, then the offending rows by index and id.
    assert (
        f"expect_column_values_to_be_unique(problem_id): 2 rows (33.3%); first: row 1 id='{traces[1].problem_id}'"
        in message
    )
    assert (
        f"expect_column_values_to_be_in_set(answer_correct): 1 row (16.7%); first: row 2 id='{wrong.problem_id}'"
        in message
    )


def test_the_distill_flow_with_an_endpoint_teacher_writes_the_programmatic_teachers_traces(tmp_path, prefect_api):
    """The real client against the solver served as a chat endpoint over HTTP: the dataset's traces are the
    programmatic teacher's with the endpoint's reasoning kept on each assistant turn, under another dataset key
    (the teacher is part of its recipe)."""
    from components.data.solver_server import SOLVER_MODEL, running_solver
    from components.envs.registry import sft_traces
    from components.stages.distill import dataset_key
    from flows.distill import distill

    overrides = FAST + ["task.train_size=12"]
    cfg = load_config("tiny-cpu", overrides)
    with running_solver(mental_max=cfg.task.teacher_mental_max) as url:
        endpoint = overrides + [f'distill.teacher="{url}"', f'distill.model="{SOLVER_MODEL}"']
        uri = distill(overrides=endpoint, home=str(tmp_path))
    assert uri.endswith(dataset_key(load_config("tiny-cpu", endpoint)))
    assert dataset_key(load_config("tiny-cpu", endpoint)) != dataset_key(cfg)
    served = read_traces(tmp_path / dataset_key(load_config("tiny-cpu", endpoint)) / "traces.parquet")
    assert all(t.reasoning for trace in served for t in trace.turns if t.role == "assistant")
    plain = [
        dataclasses.replace(tr, turns=tuple(dataclasses.replace(t, reasoning=None) for t in tr.turns)) for tr in served
    ]
    expected = sft_traces(cfg)
    assert plain == expected and len(expected) == 12


def test_the_style_shift_flow_reports_reward_per_phase_for_each_algorithm(tmp_path, prefect_api):
    from flows.style_shift import style_shift

    result = style_shift(overrides=FAST + ["task.train_size=64"], home=str(tmp_path), steps_per_phase=2)
    rows = result["phases"]
    assert [(r["algo"], r["style"], r["first_step"], r["last_step"]) for r in rows] == [
        (algo, style, 2 * i + 1, 2 * i + 2)
        for algo in ("sao", "sao-running-mean")
        for i, style in enumerate(("cute", "chuunibyou", "classical"))
    ]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert {p.name for p in (tmp_path / "reports").iterdir()} >= {
        "style-shift.md",
        "style-shift.json",
        "style-shift.png",
    }


def test_the_checkpoint_event_names_the_checkpoint_and_its_training_run():
    from flows.train import CHECKPOINT_EVENT, checkpoint_event

    event = checkpoint_event(
        load_config("tiny-cpu", ["train.max_steps=80"]),
        40,
        "s3://b/sao/checkpoints/tiny-cpu/step-00000040",
        ["train.max_steps=80"],
        "/runs/a",
    )
    assert event["event"] == CHECKPOINT_EVENT == "sao.checkpoint.saved"
    assert event["resource"]["prefect.resource.id"] == "sao.checkpoint.tiny-cpu.tir_math.40"
    assert event["payload"] == {
        "step": 40,
        "uri": "s3://b/sao/checkpoints/tiny-cpu/step-00000040",
        "preset": "tiny-cpu",
        "env": "tir_math",
        "algo": "sao",
        "overrides": ["train.max_steps=80"],
        "home": "/runs/a",
    }


def test_distill_progress_logs_each_tenth_once():
    from flows.distill import _progress

    lines = []
    progress = _progress(lines.append)
    for done in range(0, 21):
        progress(done, 20)
    # tenths 0..10 of 20 problems: done = 0, 2, 4, ..., 20 open a new tenth
    assert lines == [f"distill: {d}/20 problems" for d in range(0, 21, 2)]


def test_the_evaluate_task_picks_the_newest_checkpoint_else_the_sft_policy(tmp_path, tiny_cfg, sft_policy):
    """`model_to_score.fn`: without checkpoints the SFT policy (not registered); with some, the newest one,
    exported as an HF directory whose weights are the checkpoint's."""
    import torch

    from components.models import load_policy, save_model_dir
    from components.training.rl.checkpoint import checkpoint_store
    from flows.evaluate import model_to_score

    model, tokenizer = sft_policy
    save_model_dir(model, tokenizer, tmp_path / "models" / "sft-tir_math")
    from components.storage import mark_complete

    mark_complete(tmp_path / "models" / "sft-tir_math")
    import json

    from components.stages.recipes import sft_recipe

    (tmp_path / "models" / "sft-tir_math" / "sao_sft.json").write_text(json.dumps({"recipe": sft_recipe(tiny_cfg)}))
    directory, source, label = model_to_score.fn(tiny_cfg, tmp_path, "", None, print)
    assert (directory.name, source, label) == ("sft-tir_math", None, "sft")
    from components.training.engines.engine import TorchEngine
    from components.training.engines.settings import EngineSettings

    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p += 1.0
    store = checkpoint_store(tiny_cfg, tmp_path)
    for step, policy in ((3, model), (7, moved)):  # the policy engine's own files, as the learner writes them
        store.save(
            step,
            {},
            write=lambda d, policy=policy: TorchEngine(copy.deepcopy(policy), EngineSettings(1e-3)).save(d / "policy"),
        )
    moved = moved.state_dict()
    directory, source, label = model_to_score.fn(tiny_cfg, tmp_path, "", None, print)
    assert label == "step-7" and source.endswith("checkpoints/tiny-cpu/step-00000007")
    exported = load_policy(directory).state_dict()
    assert all(torch.equal(exported[k], moved[k]) for k in moved)
