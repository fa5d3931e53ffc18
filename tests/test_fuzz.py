"""Property tests: any trajectory, trace or engine request either parses into a valid object that round-trips,
or is refused with the documented error (ValueError, or pydantic's ValidationError / the server's BadRequest
for HTTP bodies) whose message names a field. Never another exception, and never a 500 over HTTP.

Inputs are near-valid records with one or two fields replaced by arbitrary JSON values (so the checks past the
first are reached), plus arbitrary JSON. Sized for < 60 s on two busy cores; no example database is kept.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from components.contracts.trace import Trace, Turn
from components.contracts.trajectory import FINISH_REASONS, Timings, Trajectory, trajectory_from_dict
from components.data.traces import trace_from_openai_messages, trace_from_row
from components.rollout.protocol import SamplingRequest
from components.rollout.server import BadRequest, CompletionRequest, sampling_request

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
"""Anything a JSON document (or a Parquet row) can hold, NaN and huge integers included."""


def _names_a_field(message: str, names: list[str], record=None) -> bool:
    """The message names a field of the contract, or the unknown key the record sent."""
    sent = [str(k) for k in record] if isinstance(record, dict) else []
    return any(name in message for name in names + sent)


def _json(value) -> str:
    return json.dumps(value, sort_keys=True, default=repr)  # NaN prints as NaN: equal records give equal text


# ---- trajectories -------------------------------------------------------------------------------------------------

TRAJECTORY_FIELDS = (
    [f.name for f in fields(Trajectory)]
    + [f"timings.{f.name}" for f in fields(Timings)]
    + ["trajectory: expected an object", "action token", "token ", "timings"]
)


@st.composite
def trajectory_records(draw) -> dict:
    """A valid trajectory's dict form (`asdict`)."""
    n = draw(st.integers(1, 12))
    prompt_len = draw(st.integers(0, n))
    mask = [0] * prompt_len + draw(st.lists(st.integers(0, 1), min_size=n - prompt_len, max_size=n - prompt_len))
    logprob = st.floats(-30, 0, allow_nan=False)
    return {
        "prompt_id": draw(st.text(min_size=1, max_size=6)),
        "env": draw(st.sampled_from(["tir_math", "style"])),
        "token_ids": draw(st.lists(st.integers(0, 200), min_size=n, max_size=n)),
        "action_mask": mask,
        "rollout_logprobs": [draw(logprob) if m else None for m in mask],
        "versions": [draw(st.integers(0, 5)) if m else None for m in mask],
        "reward": draw(st.floats(-1, 1)),
        "turns": draw(st.integers(0, 4)),
        "finish_reason": draw(st.sampled_from(FINISH_REASONS)),
        "prompt_len": prompt_len,
        "timings": {
            "queued": draw(st.floats(0, 2e9)),
            "started": draw(st.floats(0, 2e9) | st.just(math.nan)),
            "first_token": math.nan,
            "finished": math.nan,
        },
        "metadata": draw(st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=3)),
        "routes": None,  # recorded only under routing replay, and then bytes (Parquet, not JSON)
    }


@st.composite
def mutated(draw, records, keys: list[str]) -> dict:
    """A record with up to two fields replaced by arbitrary JSON, dropped, or an unknown one added."""
    record = draw(records)
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(keys + ["unknown_field"]))
        if draw(st.booleans()) and key in record:
            del record[key]
        else:
            record[key] = draw(json_values)
    return record


@FUZZ
@given(st.one_of(mutated(trajectory_records(), [f.name for f in fields(Trajectory)]), json_values))
def test_any_trajectory_record_parses_and_round_trips_or_is_refused_naming_a_field(record):
    try:
        trajectory = trajectory_from_dict(record)
    except ValueError as exc:
        assert _names_a_field(str(exc), TRAJECTORY_FIELDS, record), str(exc)
        return
    assert isinstance(trajectory, Trajectory)
    again = trajectory_from_dict(json.loads(json.dumps(asdict(trajectory))))  # through JSON text, NaN included
    assert _json(asdict(again)) == _json(asdict(trajectory))


@settings(max_examples=100, deadline=None, database=None)
@given(trajectory_records())
def test_valid_trajectory_records_always_parse(record):
    assert _json(asdict(trajectory_from_dict(record))) == _json(record)


# ---- traces -------------------------------------------------------------------------------------------------------

TRACE_FIELDS = [
    "problem_id",
    "answer",
    "roles",
    "contents",
    "tool_codes",
    "turns",
    "role",
    "content",
    "tool_code",
    "trace: expected an object",
    "last turn",
    "messages",
]


@st.composite
def trace_rows(draw) -> dict:
    """A valid trace's stored row: a question, k tool rounds, an answer."""
    k = draw(st.integers(0, 3))
    text = st.text(max_size=10)
    roles = ["user"] + ["assistant", "tool"] * k + ["assistant"]
    codes = [None] + [draw(text), None] * k + [None]
    return {
        "problem_id": draw(st.text(min_size=1, max_size=6)),
        "answer": draw(st.none() | st.integers(-(10**6), 10**6)),
        "roles": roles,
        "contents": [draw(text) for _ in roles],
        "tool_codes": codes,
    }


@st.composite
def mutated_turns(draw) -> dict:
    """A trace row with one entry of a turn list replaced (a role, a content or a tool call)."""
    row = draw(trace_rows())
    column = draw(st.sampled_from(["roles", "contents", "tool_codes"]))
    index = draw(st.integers(0, len(row[column]) - 1))
    row[column][index] = draw(st.sampled_from(["user", "assistant", "tool", "system"]) | json_values)
    return row


@FUZZ
@given(
    st.one_of(
        trace_rows(),
        mutated_turns(),
        mutated(trace_rows(), ["problem_id", "answer", "roles", "contents", "tool_codes"]),
        json_values,
    )
)
def test_any_trace_row_parses_and_round_trips_or_is_refused_naming_a_field(row):
    try:
        trace = trace_from_row(row)
    except ValueError as exc:
        assert _names_a_field(str(exc), TRACE_FIELDS, row), str(exc)
        return
    assert isinstance(trace, Trace) and all(isinstance(t, Turn) for t in trace.turns)
    stored = {
        "problem_id": trace.problem_id,
        "answer": trace.answer,
        "roles": [t.role for t in trace.turns],
        "contents": [t.content for t in trace.turns],
        "tool_codes": [t.tool_code for t in trace.turns],
    }
    assert trace_from_row(stored) == trace


chat_messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]),
                "content": st.none() | st.text(max_size=8),
            }
        ),
        st.fixed_dictionaries(
            {
                "role": st.just("assistant"),
                "content": st.text(max_size=4),
                "tool_calls": st.lists(
                    st.fixed_dictionaries(
                        {
                            "function": st.fixed_dictionaries(
                                {
                                    "name": st.sampled_from(["python", "bash"]),
                                    "arguments": st.sampled_from(['{"code": "print(1)"}', '{"code": 3}', "{", "[]"]),
                                }
                            )
                        }
                    ),
                    max_size=2,
                ),
            }
        ),
        json_values,
    ),
    max_size=6,
)


@FUZZ
@given(chat_messages | json_values, st.none() | st.integers())
def test_any_teacher_transcript_parses_or_is_refused_naming_a_field(messages, answer):
    try:
        trace = trace_from_openai_messages("p", messages, answer)
    except ValueError as exc:
        assert _names_a_field(str(exc), TRACE_FIELDS), str(exc)
        return
    assert trace.turns[0].role == "user" and trace.turns[-1].tool_code is None


# ---- engine requests ----------------------------------------------------------------------------------------------

REQUEST_FIELDS = list(CompletionRequest.model_fields) + ["body"]

completion_bodies = st.one_of(
    st.fixed_dictionaries(
        {"prompt": st.lists(st.integers(0, 120), min_size=1, max_size=8)},
        optional={
            "max_tokens": st.integers(-2, 70) | json_values,
            "temperature": st.floats() | json_values,
            "top_p": st.sampled_from([1.0, 0.9]),
            "top_k": st.sampled_from([-1, 0, 5]),
            "n": st.integers(0, 2),
            "seed": st.integers(-2, 2**64) | st.none(),
            "stop": st.lists(st.text(max_size=3), max_size=2) | json_values,
            "stop_token_ids": st.lists(st.integers(-2, 200), max_size=3),
            "model": st.sampled_from(["tiny", "other"]),
            "logprobs": st.sampled_from([None, 1]),
            "echo": json_values,
        },
    ),
    st.dictionaries(st.sampled_from(REQUEST_FIELDS), json_values, max_size=4),
    json_values,
)


def _named(param: str, body) -> bool:
    """`param` is a field of the request, a key the body sent, or the body itself (not an object, not JSON)."""
    return param in REQUEST_FIELDS or (isinstance(body, dict) and param in body)


def _parse(body) -> SamplingRequest | None:
    """What the server does before the engine: pydantic, then `sampling_request`. None when refused."""
    try:
        return sampling_request(CompletionRequest.model_validate(body), "tiny")
    except ValidationError as exc:  # the server's handler reports the first error's field
        loc = exc.errors()[0]["loc"]
        assert (not isinstance(body, dict) and loc == ()) or _named(str(loc[0]), body), exc.errors()[0]
    except BadRequest as exc:
        assert exc.param in REQUEST_FIELDS and exc.param in str(exc).split(":")[0], (exc.param, str(exc))
    return None


@FUZZ
@given(completion_bodies)
def test_any_completion_body_becomes_a_valid_request_or_is_refused_naming_the_field(body):
    request = _parse(body)
    if request is not None:  # what passed is what was asked for
        assert request.prompt_ids == body["prompt"] and request.max_tokens == body.get("max_tokens", 16)
        assert request.seed == body.get("seed") and request.temperature == body.get("temperature", 1.0)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """The embedded engine's server on an untrained tiny model (a short context keeps valid requests cheap)."""
    from components.config import ModelConfig
    from components.models import init_model_dir, load_policy, load_tokenizer
    from components.rollout.embedded import EmbeddedEngine
    from components.rollout.server import ServerThread, create_app

    model = init_model_dir(ModelConfig(), tmp_path_factory.mktemp("fuzz") / "model")
    engine = EmbeddedEngine(load_policy(model), load_tokenizer(model), max_batch=4, max_model_len=24).start()
    with ServerThread(create_app(engine, "tiny")) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client
    engine.shutdown()


@settings(
    max_examples=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(completion_bodies)
def test_the_server_answers_any_body_with_200_or_a_400_naming_the_field(fuzz_server, body):
    response = fuzz_server.post(
        "/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        error = response.json()["error"]
        assert _named(error["param"].split(".")[0], body), error
    else:
        choice = response.json()["choices"][0]
        assert len(choice["versions"]) == response.json()["usage"]["completion_tokens"]
    assert fuzz_server.get("/health").json()["status"] == "ok"
