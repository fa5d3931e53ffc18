"""Distillation from a chat endpoint with tool calling, over real loopback HTTP and the real sandbox.

The programmatic solver served as a chat model (`solver_server`) must come back through the client as exactly
`teacher_trace`'s traces; small scripted FastAPI apps play the teachers and failures the solver never shows.
"""

import asyncio
import dataclasses
import json
import socket

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from components.config import DistillConfig
from components.contracts.task import Task
from components.contracts.trace import Trace, Turn
from components.data.solver_server import SOLVER_MODEL, running_solver
from components.data.tasks import generate_problems, make_problem
from components.data.teacher import teacher_trace
from components.data.teacher_client import (
    REJECT_REASONS,
    TeacherEndpoint,
    TeacherError,
    distill,
    distill_task,
)
from components.data.traces import write_traces
from components.envs.grading import grade_answer
from components.envs.tir_math import TIRMathEnvironment, tasks_from_problems
from components.rollout.server import ServerThread

TOOL = TIRMathEnvironment().tool  # the environment's own tool: the teacher sees what a rollout would see
LARGE = 10**6  # above every a*b with operands <= 99: the solver answers every problem directly


def _no_rejections(**counts):
    return {**dict.fromkeys(REJECT_REASONS, 0), **counts}


@pytest.fixture(scope="module")
def problems():
    # 6 problems alternating affine / two_step (3 + 3); all operands in [2, 99].
    return generate_problems(("affine", "two_step"), 6, seed=0, operand_max=99, split="train")


@pytest.fixture(scope="module")
def solver():
    with running_solver(mental_max=0) as url:
        yield url


def _without_reasoning(trace):
    return dataclasses.replace(trace, turns=tuple(dataclasses.replace(t, reasoning=None) for t in trace.turns))


@pytest.mark.parametrize(
    "mental_max, mental_frac, tool_turns",
    [
        (0, 1.0, 3 * 1 + 3 * 2),  # every problem uses the tool: one call per affine, two per two_step problem
        (LARGE, 1.0, 0),  # every problem is answered directly
        (LARGE, 0.0, 3 * 1 + 3 * 2),  # every problem is small, but none is answered in the head
    ],
)
def test_distilled_traces_are_byte_identical_to_teacher_traces(problems, mental_max, mental_frac, tool_turns, tmp_path):
    """The teacher's reasoning is kept on each assistant turn (a student format with a reasoning channel trains on
    it); the rest is the programmatic teacher's trace, byte for byte."""
    seen = []
    with running_solver(mental_max, mental_frac) as url:
        result = distill(
            TeacherEndpoint(url, SOLVER_MODEL),
            tasks_from_problems(problems),
            TOOL,
            max_turns=4,
            concurrency=4,
            progress=lambda done, total: seen.append((done, total)),
            grade=grade_answer,
        )
    expected = [teacher_trace(p, mental_max, mental_frac) for p in problems]
    reasoning = [t.reasoning for trace in result.traces for t in trace.turns if t.role == "assistant"]
    assert reasoning and all(r in ("Box the answer.",) or r.startswith("Run print(") for r in reasoning)
    traces = [_without_reasoning(t) for t in result.traces]
    assert traces == expected
    assert sum(t.role == "tool" for trace in result.traces for t in trace.turns) == tool_turns
    assert {p.kind for p in problems} == {"affine", "two_step"}
    written = write_traces(tmp_path / "client.parquet", traces).read_bytes()
    assert written == write_traces(tmp_path / "teacher.parquet", expected).read_bytes()
    assert result.rejected == _no_rejections() and result.seconds > 0
    assert seen == [(k, 6) for k in range(1, 7)]  # one progress call per finished task, counting up


def test_a_wrong_answer_is_rejected_and_counted(solver, problems):
    tasks = tasks_from_problems(problems[:4])
    bad = tasks[1]
    tasks[1] = Task(bad.task_id, bad.prompt, bad.answer + 1)  # the teacher's (right) answer no longer grades
    result = distill(TeacherEndpoint(solver, SOLVER_MODEL), tasks, TOOL, grade=grade_answer, max_turns=4)
    assert [t.problem_id for t in result.traces] == [tasks[0].task_id, tasks[2].task_id, tasks[3].task_id]
    assert result.rejected == _no_rejections(wrong_answer=1)
    outcome = distill_task(TeacherEndpoint(solver, SOLVER_MODEL), tasks[1], TOOL, grade=grade_answer, max_turns=4)
    assert outcome.trace is None and outcome.reason == "wrong_answer"
    assert outcome.messages[-1]["content"] == f"\\boxed{{{bad.answer}}}"  # kept for inspection, not as a trace


def test_a_teacher_still_calling_the_tool_at_the_turn_limit_is_rejected(solver):
    # (2*3+4)*5 takes three replies: call print(2*3+4), call print(10*5), then \boxed{50}.
    task = tasks_from_problems([make_problem("two_step", (2, 3, 4, 5), "p")])[0]
    endpoint = TeacherEndpoint(solver, SOLVER_MODEL)
    short = distill_task(endpoint, task, TOOL, grade=grade_answer, max_turns=2)
    assert short.reason == "max_turns" and short.trace is None
    assert [m["role"] for m in short.messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert [m["content"] for m in short.messages if m["role"] == "tool"] == ["10\n", "50\n"]
    enough = distill_task(endpoint, task, TOOL, grade=grade_answer, max_turns=3)
    assert enough.reason == "accepted" and enough.trace.turns[-1] == Turn(
        "assistant", "\\boxed{50}", reasoning="Box the answer."
    )


# ---- scripted teachers ---------------------------------------------------------------------------------------


def call(*codes, content=None, name="python", arguments=None):
    """An assistant reply with one tool call per code, as vLLM serves GPT-OSS: null content plus reasoning."""
    calls = [
        {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": name, "arguments": arguments or json.dumps({"code": code})},
        }
        for k, code in enumerate(codes)
    ]
    return {
        "message": {"role": "assistant", "content": content, "tool_calls": calls, "reasoning_content": "use the tool"},
        "finish_reason": "tool_calls",
    }


def answer(text, finish_reason="stop"):
    return {"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}


class Scripted:
    """A chat server whose k-th reply to a question is `script[question][k]`, k = assistant messages so far.

    It answers the statuses in `failures` first (one per request), sleeps `delays[question]` seconds per
    request, and records every request body, the Authorization header and the most requests in flight.
    """

    def __init__(self, script, failures=(), delays=None):
        self.script, self.failures, self.delays = script, list(failures), delays or {}
        self.requests, self.auth, self.finished = [], [], []
        self.in_flight = self.peak = 0
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.chat)

    async def chat(self, request: Request):
        body = await request.json()
        self.requests.append(body)
        self.auth.append(request.headers.get("authorization"))
        if self.failures:
            status = self.failures.pop(0)
            return JSONResponse(status_code=status, content={"error": {"message": f"scripted {status}"}})
        question = body["messages"][1]["content"]
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.delays.get(question, 0.0))
        self.in_flight -= 1
        self.finished.append(question)
        reply = self.script[question][sum(m["role"] == "assistant" for m in body["messages"])]
        return {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [{"index": 0, **reply}]}


def _endpoint(url, **kwargs):
    return TeacherEndpoint(f"{url}/v1", "teacher", backoff_s=0.01, **kwargs)


def test_parallel_calls_are_split_into_consecutive_turns_and_reasoning_stays_out():
    server = Scripted(
        {"Compute 6*7+1.": [call("print(6*7)", "print(6*7+1)", content="Both at once."), answer("\\boxed{43}")]}
    )
    task = Task("p", "Compute 6*7+1.", 43)
    with ServerThread(server.app) as url:
        outcome = distill_task(
            _endpoint(url, api_key="secret", temperature=0.7, max_tokens=99), task, TOOL, grade=grade_answer
        )
    # One call per assistant turn, each followed by its own sandbox output; the content stays on the first.
    assert outcome.trace == Trace(
        "p",
        (
            Turn("user", "Compute 6*7+1."),
            Turn("assistant", "Both at once.", "print(6*7)"),
            Turn("tool", "42\n"),
            Turn("assistant", "", "print(6*7+1)"),
            Turn("tool", "43\n"),
            Turn("assistant", "\\boxed{43}"),
        ),
        43,
    )
    first, second = server.requests
    assert first["messages"][0]["role"] == "system" and first["messages"][1] == {
        "role": "user",
        "content": "Compute 6*7+1.",
    }
    assert first["tools"][0]["function"]["name"] == "python" and first["tool_choice"] == "auto"
    assert (first["model"], first["temperature"], first["max_tokens"]) == ("teacher", 0.7, 99)
    sent = second["messages"][2:]  # the assistant message goes back with its reasoning, then both results
    assert sent[0]["content"] == "Both at once." and sent[0]["reasoning_content"] == "use the tool"
    assert [(m["tool_call_id"], m["content"]) for m in sent[1:]] == [("call_0", "42\n"), ("call_1", "43\n")]
    assert server.auth == ["Bearer secret"] * 2


def test_unusable_conversations_are_rejected_by_reason():
    server = Scripted(
        {
            "bad name": [call("print(4)", name="bash")],
            "bad arguments": [call("", arguments="{not json")],
            "cut off": [answer("\\boxed{4", finish_reason="length")],
            "no box": [answer("4")],
        }
    )
    tasks = [Task(q, q, 4) for q in server.script]
    with ServerThread(server.app) as url:
        result = distill(_endpoint(url), tasks, TOOL, grade=grade_answer)
    assert result.traces == []
    assert result.rejected == {"wrong_answer": 1, "max_turns": 0, "truncated": 1, "bad_tool_call": 2}
    assert len(server.requests) == 4  # a bad call ends the conversation: nothing runs, nothing is asked again


def test_conversations_run_concurrently_and_results_keep_input_order():
    # Earlier tasks are slower (0.24 s down to 0.04 s), so they finish out of input order.
    questions = [f"q{i}" for i in range(6)]
    server = Scripted(
        {q: [answer(f"\\boxed{{{i}}}")] for i, q in enumerate(questions)},
        delays={q: 0.04 * (6 - i) for i, q in enumerate(questions)},
    )
    with ServerThread(server.app) as url:
        result = distill(
            _endpoint(url), [Task(q, q, i) for i, q in enumerate(questions)], TOOL, grade=grade_answer, concurrency=3
        )
    assert [t.problem_id for t in result.traces] == questions
    assert server.finished != questions
    assert server.peak == 3  # the semaphore's bound, and it was reached


def test_503_and_429_are_retried_with_backoff():
    server = Scripted({"Compute 2*3+4.": [call("print(2*3+4)"), answer("\\boxed{10}")]}, failures=[503, 429])
    with ServerThread(server.app) as url:
        outcome = distill_task(_endpoint(url, retries=2), Task("p", "Compute 2*3+4.", 10), TOOL, grade=grade_answer)
    assert outcome.reason == "accepted" and outcome.trace.turns[2] == Turn("tool", "10\n")
    assert len(server.requests) == 2 + 2  # two failed attempts, then the call and the answer


def test_retries_are_bounded():
    server = Scripted({}, failures=[503] * 5)
    with ServerThread(server.app) as url:
        with pytest.raises(TeacherError, match=r"problem 'p7'.*HTTP 503: scripted 503 \(after 3 attempts\)") as err:
            distill_task(_endpoint(url, retries=2), Task("p7", "q", 1), TOOL, grade=grade_answer)
    assert len(server.requests) == 3 and err.value.status == 503


def test_a_400_is_not_retried_and_names_the_endpoint_and_problem():
    server = Scripted({}, failures=[400])
    with ServerThread(server.app) as url:
        with pytest.raises(TeacherError) as err:
            distill(_endpoint(url, retries=3), [Task("p9", "q", 1)], TOOL, grade=grade_answer)
    assert str(err.value) == f"teacher {url}/v1/chat/completions failed on problem 'p9': HTTP 400: scripted 400"
    assert len(server.requests) == 1 and err.value.status == 400


def test_connection_errors_are_retried_then_raised():
    with socket.socket() as sock:  # a port nobody listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(
        TeacherError,
        match=rf"teacher http://127.0.0.1:{port}/v1/chat/completions failed on "
        r"problem 'p': ConnectError.*\(after 2 attempts\)",
    ):
        distill_task(_endpoint(f"http://127.0.0.1:{port}", retries=1), Task("p", "q", 1), TOOL, grade=grade_answer)


def test_a_slow_endpoint_times_out():
    server = Scripted({"q": [answer("\\boxed{1}")]}, delays={"q": 0.5})
    with ServerThread(server.app) as url:
        with pytest.raises(TeacherError, match=r"problem 'p': ReadTimeout"):
            distill_task(_endpoint(url, retries=0, timeout_s=0.1), Task("p", "q", 1), TOOL, grade=grade_answer)


# ---- the solver's answer schema and its checks ----------------------------------------------------------------


def _ask(url, messages, **extra):
    body = {
        "model": SOLVER_MODEL,
        "messages": messages,
        "tools": [{"type": "function", "function": {"name": "python"}}],
        **extra,
    }
    return httpx.post(f"{url}/chat/completions", json=body)


def test_solver_replies_in_the_openai_schema(solver):
    question = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Compute (2*3+4)*5."}]
    first = _ask(solver, question).json()
    assert first["object"] == "chat.completion" and first["model"] == SOLVER_MODEL
    choice = first["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None and message["reasoning_content"]
    (tool_call,) = message["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["function"]["name"] == "python"
    assert json.loads(tool_call["function"]["arguments"]) == {"code": "print(2*3+4)"}
    usage = first["usage"]
    assert usage["prompt_tokens"] == len("be brief") + len("Compute (2*3+4)*5.")  # characters: no tokenizer
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    def result(output, call_id=tool_call["id"]):
        return {"role": "tool", "tool_call_id": call_id, "content": output}

    history = question + [message, result("10\n")]
    second = _ask(solver, history).json()["choices"][0]
    assert json.loads(second["message"]["tool_calls"][0]["function"]["arguments"]) == {"code": "print(10*5)"}
    history += [second["message"], result("50\n", second["message"]["tool_calls"][0]["id"])]
    final = _ask(solver, history).json()["choices"][0]
    assert final["finish_reason"] == "stop" and final["message"]["content"] == "\\boxed{50}"
    assert final["message"]["tool_calls"] == []
    assert httpx.get(f"{solver}/models").json()["data"][0]["id"] == SOLVER_MODEL

    # A tool result that is not what the sandbox prints, or that answers another call, is refused.
    wrong = _ask(solver, question + [message, result("11\n")])
    assert wrong.status_code == 400
    assert wrong.json()["error"]["param"] == "messages[3].content"
    assert "expected tool output '10\\n', got '11\\n'" in wrong.json()["error"]["message"]
    other = _ask(solver, question + [message, result("10\n", "call_other")]).json()["error"]
    assert other["param"] == "messages[3].tool_call_id"
    done = _ask(solver, history + [final["message"]]).json()["error"]
    assert done["param"] == "messages[6]" and "already answered" in done["message"]


@pytest.mark.parametrize(
    "change, param",
    [
        ({"messages": None}, "messages"),  # missing
        ({"model": "gpt-4"}, "model"),  # not served here
        ({"tools": []}, "tools"),  # no python tool
        ({"messages": [{"role": "user", "content": "What is 2+2?"}]}, "messages[0].content"),
        ({"messages": [{"role": "robot", "content": "Compute 2*3+4."}]}, "messages[0].role"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages"),  # no question first
        ({"temperature": -1}, "temperature"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(solver, change, param):
    body = {
        "model": SOLVER_MODEL,
        "messages": [{"role": "user", "content": "Compute 2*3+4."}],
        "tools": [{"type": "function", "function": {"name": "python"}}],
        **change,
    }
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(f"{solver}/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)


# ---- configuration and input checks ---------------------------------------------------------------------------


def test_endpoint_from_config_and_bad_input():
    cfg = DistillConfig(
        teacher="http://teacher:8000/v1",
        model="openai/gpt-oss-120b",
        temperature=0.6,
        max_tokens=2048,
        timeout_s=60.0,
        retries=5,
    )
    endpoint = TeacherEndpoint.from_config(cfg, api_key="k")
    assert endpoint == TeacherEndpoint("http://teacher:8000/v1", "openai/gpt-oss-120b", "k", 0.6, 2048, 60.0, 5)
    assert endpoint.url == "http://teacher:8000/v1/chat/completions"
    with pytest.raises(ValueError, match="distill.teacher"):
        TeacherEndpoint.from_config(DistillConfig())
    with pytest.raises(ValueError, match="base_url"):
        TeacherEndpoint("ftp://teacher", "m")
    with pytest.raises(ValueError, match="retries"):
        TeacherEndpoint("http://teacher/v1", "m", retries=-1)
    with pytest.raises(ValueError, match=r"task t3: answer must be an integer, got '3/4'"):
        distill(endpoint, [Task("t3", "q", "3/4")], TOOL, grade=grade_answer)  # refused before any request
    with pytest.raises(ValueError, match="concurrency"):
        distill(endpoint, [], TOOL, grade=grade_answer, concurrency=0)
