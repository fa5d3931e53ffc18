"""Bad input is refused with a message naming the field, never a traceback or a 500.

The CLI: every refused input ends with one `sao: ...` line on stderr and exit status 2; an unexpected exception
is `sao: internal error: ...` and exit status 1 (SAO_DEBUG=1 shows its traceback). Datasets, traces and
trajectories: ValueError naming the file, the row and the field. The engine's HTTP API: 4xx with a JSON error
whose `param` names the field, and the server keeps serving.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import subprocess
import sys
from dataclasses import asdict

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.cli import main
from components.cli.run_flows import _NoTracebackForInputErrors
from components.contracts.trace import Trace, Turn
from components.contracts.trajectory import (
    Timings,
    read_trajectories,
    trajectory_from_dict,
    write_trajectories,
)
from components.data.problem_sets import load_tasks
from components.data.traces import read_traces, trace_from_openai_messages, trace_from_row, write_traces
from components.rollout.protocol import SamplingRequest
from tests.factories import trajectory as _traj

# ---- the CLI ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A model directory, a file that is not a directory, an empty directory and broken datasets."""
    from components.config import ModelConfig
    from components.models import init_model_dir

    root = tmp_path_factory.mktemp("bad-input")
    init_model_dir(ModelConfig(), root / "model")
    (root / "notes.txt").write_text("not a directory\n")
    (root / "empty").mkdir()
    (root / "corrupt.parquet").write_text("not parquet")
    return root


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """Exit status and stderr of `sao argv`, run in this process the way the `sao` script runs it."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


CLI_CASES = [
    # flag: a path that cannot be what it names
    (["eval", "--model", "{root}/nonexistent"], "--model: {root}/nonexistent is not a model directory"),
    (["eval", "--model", "{root}/empty"], "--model: {root}/empty is not a model directory"),
    (["rollout", "--out", "{root}/r.parquet", "--model", "{root}/notes.txt"], "--model: {root}/notes.txt"),
    (["engine", "serve", "--model", "{root}/nonexistent"], "--model: {root}/nonexistent"),
    (
        ["eval", "--home", "{root}/home", "--model", "{root}/model", "--tasks", "{root}/nope.jsonl"],
        "--tasks: {root}/nope.jsonl is not a file",
    ),
    (
        ["rollout", "--home", "{root}/home", "--out", "{root}/r.parquet", "--tasks", "{root}/empty"],
        "--tasks: {root}/empty is not a file",
    ),
    (["gate", "{root}/nope.parquet", "--home", "{root}/home"], "URI: {root}/nope.parquet is not a file"),
    (["train", "--home", "{root}/home", "--critic", "{root}/empty"], "--critic: {root}/empty is not a critic"),
    (["eval", "--home", "{root}/notes.txt", "--model", "{root}/model"], "--home: {root}/notes.txt is not a directory"),
    (["eval", "--home", "{root}/home", "--checkpoint", "3"], "--checkpoint: no complete checkpoint at step 3"),
    (["train", "--home", "{root}/home", "--rollback-to", "5"], "--rollback-to: no complete checkpoint at step 5"),
    (["train", "--replay", "{root}/home", "--algo", "grpo"], "--replay: takes the recorded run's config"),
    (["model", "init", "--out", "/proc/no-such-dir/m"], "--out: cannot write a model directory at /proc/no-such-dir/m"),
    # numbers
    (["train", "--max-steps", "-1"], "argument --max-steps: must be >= 1, got -1"),
    (["train", "--max-steps", "many"], "argument --max-steps: expected an integer, got 'many'"),
    (["eval", "--samples", "0"], "argument --samples: must be >= 1, got 0"),
    (["eval", "--checkpoint", "-3"], "argument --checkpoint: must be >= 0, got -3"),
    (["rollout", "--out", "x.parquet", "--episodes", "0"], "argument --episodes: must be >= 1, got 0"),
    (["sweep", "--seeds", "0"], "argument --seeds: must be >= 1, got 0"),
    (["engine", "serve", "--model", "m", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
    (["engine", "serve", "--model", "m", "--max-batch", "0"], "argument --max-batch: must be >= 1, got 0"),
    (["teacher", "serve", "--port", "99999"], "argument --port: must be in [0, 65535], got 99999"),
    (["teacher", "serve", "--mental-frac", "1.5"], "argument --mental-frac: must be in [0, 1], got 1.5"),
    (["style-shift", "--steps-per-phase", "0"], "argument --steps-per-phase: must be >= 1, got 0"),
    # the config: presets and --set
    (["train", "--preset", "nope"], "config error: preset: unknown preset 'nope'"),
    (["train", "--home", "{root}/home", "--set", "sft.stepz=3"], "config error: sft.stepz: unknown field"),
    (["train", "--home", "{root}/home", "--set", "sft.steps=abc"], "config error: sft.steps: Input should be a valid"),
    (["train", "--home", "{root}/home", "--set", "sft.steps"], "config error: override 'sft.steps': expected key."),
    (["train", "--home", "{root}/home", "--set", "sft.steps=[1,"], "config error: sft.steps: Input should be a valid"),
    (["train", "--home", "{root}/home", "--set", "sft.steps.x=1"], "config error: sft.steps: not a table"),
    (["train", "--home", "{root}/home", "--set", "sft..steps=1"], "config error: override 'sft..steps=1': empty part"),
    (
        ["train", "--home", "{root}/home", "--set", "sft.lr=nan"],
        "config error: sft.lr: Input should be a finite number",
    ),
    (
        ["train", "--home", "{root}/home", "--set", "sft.seed=99999999999999999999999"],
        "config error: sft.seed: Input should be less than 9223372036854775808",
    ),
    (["sweep", "--seeds", "2", "--first-seed", "-1"], "argument --first-seed: must be >= 0, got -1"),
    (["train", "--home", "{root}/home", "--algo", "bogus"], "config error: train.algo: Input should be 'sao'"),
    (
        ["eval", "--home", "{root}/home", "--env", "bogus"],
        "env.name: no environment 'bogus' in the 'sao.environments' entry-point group",
    ),
    (["distill", "--home", "{root}/home", "--teacher", "ftp://x"], "config error: distill.teacher: must be"),
    (
        ["distill", "--home", "{root}/home", "--teacher", "http://127.0.0.1:9/v1"],
        "config error: distill.model: required when distill.teacher is a URL",
    ),
    # argparse itself
    (["bogus"], "argument command: invalid choice: 'bogus'"),
    (["eval", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["model", "init"], "the following arguments are required: --out"),
    # servers: the port is tried before anything loads
    (["teacher", "serve", "--host", "256.1.1.1", "--port", "8124"], "--host/--port: cannot listen on 256.1.1.1:8124"),
]


@pytest.mark.parametrize("argv, message", CLI_CASES, ids=[" ".join(a)[:60] for a, _ in CLI_CASES])
def test_cli_refuses_bad_input_with_one_sao_line_and_exit_2(files, capsys, argv, message):
    code, err = _cli([a.format(root=files) for a in argv], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("sao: ") and message.format(root=files) in last, err


def test_a_port_in_use_is_refused_before_the_engine_loads(files, capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, err = _cli(["engine", "serve", "--model", str(files / "model"), "--port", str(port)], capsys)
    assert code == 2 and f"sao: --host/--port: cannot listen on 127.0.0.1:{port}: " in err


def test_an_unexpected_exception_is_an_internal_error_with_exit_1(monkeypatch, capsys):
    import components.cli.run_mlflow as run_mlflow

    def broken(*_):
        raise KeyError("boom")

    monkeypatch.setattr(run_mlflow, "run_compare", broken)
    monkeypatch.delenv("SAO_DEBUG", raising=False)
    code, err = _cli(["compare", "r1"], capsys)
    assert code == 1
    assert err == "sao: internal error: KeyError: 'boom' (run with SAO_DEBUG=1 for the traceback)\n"
    monkeypatch.setenv("SAO_DEBUG", "1")
    with pytest.raises(KeyError, match="boom"):  # the traceback, for whoever debugs it
        main(["compare", "r1"])


def test_prefect_console_lines_lose_the_traceback_of_an_input_error_only():
    quiet = _NoTracebackForInputErrors()

    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord(
            "prefect.flow_runs", logging.ERROR, __file__, 1, "Encountered exception", None, (type(exc), exc, None)
        )

    refused = record(FileNotFoundError("problem set not found: x.jsonl"))
    assert quiet.filter(refused) and refused.exc_info is None  # the line stays, the traceback goes
    bug = record(KeyError("boom"))
    assert quiet.filter(bug) and bug.exc_info is not None


def test_the_sao_script_ends_with_one_line_and_status_2(files, prefect_env):
    """The real entry point, as a user runs it: no traceback anywhere in its output, also from a failing flow."""
    commands = [
        (["eval", "--model", "/nonexistent"], "sao: --model: /nonexistent is not a model directory"),
        (["train", "--set", "sft.steps=abc"], "sao: config error: sft.steps: Input should be a valid integer"),
        (
            ["gate", str(files / "corrupt.parquet"), "--home", str(files / "home")],
            f"sao: {files / 'corrupt.parquet'}: not a readable Parquet file of traces",
        ),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "components.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**prefect_env, "SAO_DEBUG": ""},
        )
        for argv, _ in commands
    ]
    for proc, (_, message) in zip(procs, commands):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-2000:]
        assert "Traceback" not in out + err
        assert err.strip().splitlines()[-1].startswith(message), err[-2000:]


# ---- datasets ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"problem": "q", "answer": 1}\n\xff\xfe\n', r"bad.jsonl: line 2 is not UTF-8 \(byte 0xff at offset 30\)"),
        (b"", r"bad.jsonl: no rows \(an empty problem set\)"),
        (
            b'{"problem": "q", "answer": 1}\n{"problem": "q2", "answer": 2\n',
            r"bad.jsonl: line 2 \(row 1\) is not valid",
        ),
        (b'{"problem": "q", "answer": 1}\n[1, 2]\n', r"bad.jsonl: line 2 \(row 1\) is not a JSON object"),
        (b'{"problem": 12, "answer": 1}\n', r"row 0: field 'problem' must be a string, got int"),
        (b'{"problem": "q", "answer": ""}\n', r"row 0: field 'answer' is missing or empty"),
        (b'{"question": "q", "answer": 1}\n', r"row 0: field 'problem' is missing or empty"),
        (
            b'{"problem": "' + b"x" * 600 + b'", "answer": 1}\n',
            r"row 0: field 'problem' has 600 characters, more than max_prompt_chars=512",
        ),
    ],
)
def test_a_broken_problem_set_names_the_file_row_and_field(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_tasks(tmp_path / "bad.jsonl", max_prompt_chars=512)


def test_a_corrupt_or_mistyped_parquet_dataset_names_the_file_row_and_field(tmp_path):
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: not a readable Parquet file"):
        load_tasks(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: not a readable Parquet file of traces"):
        read_traces(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: not a readable Parquet file of trajectories"):
        read_trajectories(tmp_path / "bad.parquet")
    traces = pa.table(
        {
            "problem_id": ["p0"],
            "answer": [3],
            "roles": [["user", "assistant"]],
            "contents": [["q", "a"]],
            "tool_codes": [[None, 7]],
        },
        schema=pa.schema(
            [
                ("problem_id", pa.string()),
                ("answer", pa.int64()),
                ("roles", pa.list_(pa.string())),
                ("contents", pa.list_(pa.string())),
                ("tool_codes", pa.list_(pa.int64())),
            ]
        ),
    )
    pq.write_table(traces, tmp_path / "typed.parquet")
    with pytest.raises(ValueError, match=r"typed.parquet: row 0: trace p0: turns\[1\].tool_code: must be a string"):
        read_traces(tmp_path / "typed.parquet")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"token_ids": "5 6 7 8 9"}, "trajectory p: token_ids must be a list, got '5 6 7 8 9'"),
        ({"token_ids": [5, 6, -7, 8, 9]}, r"trajectory p: token_ids\[2\] must be a non-negative integer, got -7"),
        ({"token_ids": [5, 6, 7.0, 8, 9]}, r"token_ids\[2\] must be a non-negative integer, got 7.0"),
        ({"action_mask": [0, 0, 2, 0, 1]}, r"action_mask\[2\] must be 0 or 1, got 2"),
        ({"rollout_logprobs": [None, None, "-0.5", None, -1.0]}, r"rollout_logprobs\[2\] must be a number or null"),
        ({"rollout_logprobs": [None, None, math.nan, None, -1.0]}, "action token 2 needs a finite log-prob"),
        ({"versions": [None, None, -3, None, 4]}, r"versions\[2\] must be a non-negative integer or null, got -3"),
        ({"reward": "1.0"}, "reward must be a number, got '1.0'"),
        ({"reward": math.inf}, "reward must be finite, got inf"),
        ({"turns": -1}, "turns must be a non-negative integer, got -1"),
        ({"prompt_len": 9}, r"prompt_len must be in \[0, 5\] \(len\(token_ids\)\), got 9"),
        ({"prompt_len": -1}, r"prompt_len must be in \[0, 5\]"),
        ({"prompt_id": ""}, "trajectory: prompt_id must be a non-empty string, got ''"),
        ({"env": 3}, "env must be a non-empty string, got 3"),
        ({"finish_reason": None}, "finish_reason must be a string, got None"),
        ({"timings": Timings(queued=math.nan)}, "timings.queued must be a finite number, got nan"),
        ({"timings": Timings(queued=0.0, finished="late")}, "timings.finished must be a number"),
        ({"metadata": {1: "x"}}, "metadata must be an object with string keys"),
    ],
)
def test_a_mistyped_trajectory_names_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        _traj(**changes).validate()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("versions"), r"trajectory: missing field\(s\) \['versions'\]"),
        (lambda d: d.update(rewards=[0.0]), r"trajectory: unknown field\(s\) \['rewards'\]"),
        (lambda d: d.update(timings={"started": 1.0}), r"timings must have the keys .* \(queued required\)"),
        (lambda d: d.update(timings=3), "timings must be a Timings, got 3"),
        (lambda d: d.update(metadata="{not json"), "metadata is not a JSON object"),
        (lambda d: d.update(action_mask=[0, 0, 1]), "action_mask has 3 entries, token_ids has 5"),
    ],
)
def test_a_malformed_trajectory_record_names_the_field(change, message):
    record = asdict(_traj())
    assert trajectory_from_dict(copy.deepcopy(record)) == _traj()  # the dict form round-trips
    change(record)
    with pytest.raises(ValueError, match=message):
        trajectory_from_dict(record)
    with pytest.raises(ValueError, match="trajectory: expected an object"):
        trajectory_from_dict([1, 2])


def test_a_malformed_trajectory_file_names_the_row(tmp_path):
    path = write_trajectories(tmp_path / "t.parquet", [_traj(), _traj(prompt_id="q")])
    rows = pq.read_table(path).to_pylist()
    rows[1]["versions"][2] = -3  # a negative version
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(path)), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: row 1: trajectory q: versions\[2\] must be a non-negative"):
        read_trajectories(tmp_path / "bad.parquet")
    pq.write_table(pq.read_table(path).drop_columns(["timings"]), tmp_path / "short.parquet")
    with pytest.raises(ValueError, match=r"short.parquet: row 0: trajectory: missing field\(s\) \['timings'\]"):
        read_trajectories(tmp_path / "short.parquet")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Trace("", (Turn("user", "q"), Turn("assistant", "a")), 1), "trace: problem_id must be a non-empty"),
        (lambda: Trace("p", [Turn("user", "q"), Turn("assistant", "a")], 1), "trace p: turns must be a tuple of Turn"),
        (lambda: Trace("p", (Turn("user", "q"), Turn("assistant", "a")), "42"), "trace p: answer must be an integer"),
        (lambda: Trace("p", (Turn("user", "q"), Turn("assistant", "a")), True), "trace p: answer must be an integer"),
        (lambda: Turn("system", "q"), "role: must be one of \\['user', 'assistant', 'tool'\\], got 'system'"),
        (lambda: Turn("user", None), "content: must be a string, got None"),
        (lambda: Turn("assistant", "a", 7), "tool_code: must be a string or None, got 7"),
        (
            lambda: trace_from_row({"problem_id": "p", "answer": 1, "roles": ["user"], "contents": ["q"]}),
            r"trace: missing field\(s\) \['tool_codes'\]",
        ),
        (
            lambda: trace_from_row({"problem_id": "p", "answer": 1, "roles": "user", "contents": [], "tool_codes": []}),
            "trace p: roles must be a list, got str",
        ),
        (
            lambda: trace_from_row(
                {
                    "problem_id": "p",
                    "answer": 1,
                    "roles": ["user", "assistant"],
                    "contents": ["q"],
                    "tool_codes": [None, None],
                }
            ),
            "trace p: contents has 1 entries, roles has 2",
        ),
        (lambda: trace_from_openai_messages("p", "hello", 1), "messages: expected a list of chat messages, got str"),
        (lambda: trace_from_openai_messages("p", ["hello"], 1), r"messages\[0\]: expected an object, got str"),
        (
            lambda: trace_from_openai_messages("p", [{"role": "user", "content": 5}], 1),
            r"messages\[0\].content: expected a string, got int",
        ),
        (
            lambda: trace_from_openai_messages("p", [{"role": "assistant", "tool_calls": {"a": 1}}], 1),
            r"messages\[0\].tool_calls: expected a list of exactly one call object",
        ),
        (
            lambda: trace_from_openai_messages("p", [{"role": "assistant", "tool_calls": [{"function": "python"}]}], 1),
            r"messages\[0\].tool_calls\[0\].function: expected an object, got str",
        ),
        (
            lambda: trace_from_openai_messages(
                "p",
                [{"role": "assistant", "tool_calls": [{"function": {"name": "python", "arguments": '{"code": 3}'}}]}],
                1,
            ),
            r"messages\[0\].tool_calls\[0\].function.arguments: 'code' must be a string, got int",
        ),
    ],
)
def test_a_malformed_trace_names_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_traces_round_trip_through_their_row_form(tmp_path):
    trace = Trace(
        "p",
        (Turn("user", "q"), Turn("assistant", "", "print(1)"), Turn("tool", "1\n"), Turn("assistant", "\\boxed{1}")),
        1,
    )
    rows = pq.read_table(write_traces(tmp_path / "t.parquet", [trace])).to_pylist()
    assert trace_from_row(rows[0]) == trace


# ---- the engine's HTTP API --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_ids": (1, 2)}, "prompt: must be a non-empty list of token ids"),
        ({"prompt_ids": [1, True]}, "prompt: token ids must be non-negative integers"),
        ({"max_tokens": 2.0}, "max_tokens: must be an integer >= 1, got 2.0"),
        ({"temperature": math.inf}, "temperature: must be a finite number >= 0, got inf"),
        ({"temperature": math.nan}, "temperature: must be a finite number >= 0, got nan"),
        ({"stop_token_ids": (-1,)}, r"stop_token_ids: must be non-negative integers, got \(-1,\)"),
        ({"stop": ("",)}, r"stop: must be non-empty strings, got \(''\,\)"),
        ({"seed": 2**63}, r"seed: must be an integer in \[0, 2\*\*63\), got 9223372036854775808"),
    ],
)
def test_a_bad_sampling_request_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingRequest(**{"prompt_ids": [1, 2], **kwargs})


@pytest.fixture(scope="module")
def bare_server(files):
    """The embedded engine's server on an untrained tiny model (bad requests need no trained policy)."""
    from components.models import load_policy, load_tokenizer
    from components.rollout.embedded import EmbeddedEngine
    from components.rollout.server import ServerThread, create_app

    model = files / "model"
    engine = EmbeddedEngine(load_policy(model), load_tokenizer(model), max_batch=4, max_model_len=64).start()
    with ServerThread(create_app(engine, "tiny")) as url:
        yield url
    engine.shutdown()


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": 5}, 400, "prompt"),  # not a list
        ({"prompt": [1, True]}, 400, "prompt"),  # a bool is no token id
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": [1, 2], "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": [1, 2], "max_tokens": 10**30}, 400, "prompt"),  # beyond the context (64 tokens)
        ({"prompt": [1, 2], "seed": 2**70}, 400, "seed"),  # torch's generator would overflow (500)
        ({"prompt": [1, 2], "seed": -1}, 400, "seed"),
        ({"prompt": [1, 2], "stop_token_ids": [-5]}, 400, "stop_token_ids"),
        ({"prompt": [1, 2], "stop": [""]}, 400, "stop"),
        ({"prompt": [1, 2], "echo": True}, 400, "echo"),  # unknown fields are refused, not ignored
        ({"prompt": [1, 2], "presence_penalty": 0.5}, 400, "presence_penalty"),
        ([1, 2], 400, "body"),  # not an object
    ],
)
def test_a_bad_completion_request_gets_a_4xx_naming_the_field(bare_server, body, status, param):
    response = httpx.post(f"{bare_server}/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == param and error["message"].startswith(param), error


@pytest.mark.parametrize(
    "raw, param",
    [
        (b"{not json", "body"),
        (b"", "body"),
        (b'{"prompt": [1, 2], "temperature": NaN}', "temperature"),
        (b'{"prompt": [1, 2], "temperature": Infinity}', "temperature"),
        (b'{"prompt": [1, 2], "top_p": NaN}', "top_p"),
    ],
)
def test_broken_json_gets_a_400(bare_server, raw, param):
    response = httpx.post(f"{bare_server}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_an_oversized_body_gets_a_413(bare_server):
    from components.rollout.server import MAX_BODY_BYTES

    response = httpx.post(
        f"{bare_server}/v1/completions",
        content=b" " * (MAX_BODY_BYTES + 1),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413 and response.json()["error"]["param"] == "body"


def test_bad_weights_requests_get_a_400_and_the_server_keeps_serving(bare_server, files):
    cases = [
        ({"path": str(files / "nonexistent"), "version": 1}, "path", "is neither a safetensors file"),
        ({"path": str(files / "notes.txt"), "version": 1}, "path", "Error while deserializing header"),
        ({"path": str(files / "empty"), "version": 1}, "path", "has no config.json"),
        ({"path": "a\u0000b", "version": 1}, "path", "is neither a safetensors file"),
        ({"path": "", "version": 1}, "path", "at least 1 character"),
        ({"path": str(files / "model"), "version": -1}, "version", "greater than or equal to 0"),
        ({"path": str(files / "model"), "version": 0}, "version", "must be greater than the current version 0"),
        ({"path": str(files / "model"), "version": 1, "force": True}, "force", "Extra inputs"),
        ({"path": str(files / "model")}, "version", "Field required"),
    ]
    for body, param, message in cases:
        response = httpx.post(f"{bare_server}/v1/weights", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"], error
    assert httpx.get(f"{bare_server}/health").json()["status"] == "ok"
    served = httpx.post(f"{bare_server}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=30)
    assert served.status_code == 200 and len(served.json()["choices"][0]["versions"]) == 2
    assert json.loads(served.text)["model"] == "tiny"
