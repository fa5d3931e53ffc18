"""The programmatic solver served as a tool-calling chat model: the embedded stand-in for the teacher endpoint.

`POST /v1/chat/completions` reads the conversation, parses the user's question back into a `Problem`
(`tasks.make_problem`; the two question templates of `tasks.py`), computes `teacher_trace(problem,
mental_max)` and answers with that trace's next assistant turn: a `python` tool call
(`finish_reason: "tool_calls"`) or the final answer (`finish_reason: "stop"`), in the OpenAI response schema.
`GET /v1/models` lists the one model. So `teacher_client.distill` runs the production code path (HTTP, tool
calls, the sandbox, rejection sampling) with no model, and its traces equal `teacher_trace`'s.

Like GPT-OSS behind vLLM, a tool-call reply has `content: null` and a short `reasoning_content`. The
conversation so far must be a prefix of the solver's own trace: every tool message must carry the output the
solver expects (the sandbox's stdout) and answer the preceding call's id; anything else is HTTP 400 with an
OpenAI-style error whose `param` names the message and field. Usage counts characters (there is no
tokenizer). Temperature and max_tokens are accepted and ignored: the solver is deterministic and short.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from components.contracts.trace import Turn
from components.data.tasks import Problem, make_problem
from components.data.teacher import teacher_trace
from components.rollout.server import ServerThread

SOLVER_MODEL = "sao-programmatic-solver"
"""The model name the solver serves (and accepts)."""
_QUESTIONS = (  # inverse of make_problem's templates
    ("affine", re.compile(r"Compute (\d+)\*(\d+)\+(\d+)\.")),
    ("two_step", re.compile(r"Compute \((\d+)\*(\d+)\+(\d+)\)\*(\d+)\.")),
)


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # reasoning_content and other vendor fields

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    temperature: float = Field(1.0, ge=0.0)
    max_tokens: int | None = Field(None, ge=1)
    n: int = 1


class BadRequest(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def parse_question(question: str, problem_id: str = "chat") -> Problem:
    """The `Problem` whose question is `question`; ValueError when it matches neither template."""
    for kind, pattern in _QUESTIONS:
        match = pattern.fullmatch(question.strip())
        if match:
            return make_problem(kind, tuple(int(g) for g in match.groups()), problem_id)
    raise ValueError(f"not a question of the synthetic task: {question!r}")


def next_turn(messages: list[ChatMessage], mental_max: int, mental_frac: float = 1.0) -> Turn:
    """The solver's next assistant turn after `messages`; `BadRequest` naming the message that departs from
    the solver's own trace."""
    history = [(i, m) for i, m in enumerate(messages) if m.role != "system"]
    if not history or history[0][1].role != "user":
        raise BadRequest("messages", "the conversation must start with the user's question")
    first, user = history[0]
    try:
        problem = parse_question(user.content or "")
    except ValueError as exc:
        raise BadRequest(f"messages[{first}].content", str(exc)) from exc
    trace = teacher_trace(problem, mental_max, mental_frac)
    call_id = None
    for step, (i, message) in enumerate(history[1:], start=1):
        if step >= len(trace.turns):
            raise BadRequest(f"messages[{i}]", "the conversation is already answered")
        call_id = _check_message(i, message, trace.turns[step], call_id)
    following = len(history)
    if following >= len(trace.turns):
        raise BadRequest(f"messages[{history[-1][0]}]", "the conversation is already answered")
    if trace.turns[following].role != "assistant":
        raise BadRequest(f"messages[{history[-1][0]}]", "the tool call has no tool message with its result")
    return trace.turns[following]


def _check_message(i: int, message: ChatMessage, expected: Turn, call_id: str | None) -> str | None:
    """Check message `i` against the trace's turn; returns the id of the call it makes (tool results: None)."""
    if message.role != expected.role:
        raise BadRequest(f"messages[{i}].role", f"expected {expected.role!r}, got {message.role!r}")
    if message.role == "tool":
        if message.tool_call_id != call_id:
            raise BadRequest(
                f"messages[{i}].tool_call_id",
                f"expected {call_id!r} (the preceding call), got {message.tool_call_id!r}",
            )
        if message.content != expected.content:
            raise BadRequest(
                f"messages[{i}].content", f"expected tool output {expected.content!r}, got {message.content!r}"
            )
        return None
    calls = message.tool_calls or []
    if expected.tool_code is None:
        if calls or message.content != expected.content:
            raise BadRequest(f"messages[{i}].content", f"expected the answer {expected.content!r}")
        return None
    if len(calls) != 1 or calls[0].function.name != "python":
        raise BadRequest(f"messages[{i}].tool_calls", f"expected one 'python' call running {expected.tool_code!r}")
    try:
        code = json.loads(calls[0].function.arguments)["code"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise BadRequest(f"messages[{i}].tool_calls[0].function.arguments", "no JSON 'code' field") from exc
    if code != expected.tool_code:
        raise BadRequest(
            f"messages[{i}].tool_calls[0].function.arguments", f"expected code {expected.tool_code!r}, got {code!r}"
        )
    return calls[0].id


def _reasoning(turn: Turn) -> str:
    """A short `reasoning_content`, as GPT-OSS through vLLM sends (the client keeps it on the trace's turn)."""
    return f"Run {turn.tool_code} in the python tool." if turn.tool_code is not None else "Box the answer."


def chat_response(turn: Turn, request: ChatRequest, model_name: str) -> dict:
    """The OpenAI chat-completion object for the solver's `turn`."""
    if turn.tool_code is not None:
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": "python", "arguments": json.dumps({"code": turn.tool_code})},
            }
        ]
        message = {
            "role": "assistant",
            "content": turn.content or None,
            "tool_calls": calls,
            "reasoning_content": _reasoning(turn),
        }
        finish_reason, written = "tool_calls", calls[0]["function"]["arguments"]
    else:
        message = {
            "role": "assistant",
            "content": turn.content,
            "tool_calls": [],
            "reasoning_content": _reasoning(turn),
        }
        finish_reason, written = "stop", turn.content
    prompt_chars = sum(len(m.content or "") for m in request.messages)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": prompt_chars,
            "completion_tokens": len(written),
            "total_tokens": prompt_chars + len(written),
        },
    }


def _error(status: int, message: str, param: str | None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": "BadRequestError", "param": param, "code": status}},
    )


def create_app(mental_max: int = 0, mental_frac: float = 1.0, model_name: str = SOLVER_MODEL) -> FastAPI:
    """The solver's FastAPI app; `mental_max` and `mental_frac` as in `teacher_trace`."""
    if mental_max < 0:
        raise ValueError(f"mental_max: must be >= 0, got {mental_max}")
    if not 0.0 <= mental_frac <= 1.0:
        raise ValueError(f"mental_frac: must be in [0, 1], got {mental_frac}")
    app = FastAPI(title="sao programmatic solver")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [p for p in first["loc"] if p != "body"]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "body"
        return _error(400, f"{param}: {first['msg']}", param)

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc), exc.param)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "sao"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> dict:
        if body.model != model_name:
            raise BadRequest("model", f"{body.model!r} is not served here (serving {model_name!r})")
        if body.n != 1:
            raise BadRequest("n", f"only n=1 is supported, got {body.n}")
        names = [(t.get("function") or {}).get("name") for t in body.tools or []]
        if "python" not in names:
            raise BadRequest("tools", f"the solver needs a function tool named 'python', got {names}")
        return chat_response(next_turn(body.messages, mental_max, mental_frac), body, model_name)

    return app


def serve_solver(host: str = "127.0.0.1", port: int = 8000, mental_max: int = 0, mental_frac: float = 1.0) -> None:
    """Serve the solver with uvicorn until interrupted (`sao` CLI); its base URL is `http://host:port/v1`."""
    uvicorn.run(create_app(mental_max, mental_frac), host=host, port=port, log_level="warning")


@contextlib.contextmanager
def running_solver(mental_max: int = 0, mental_frac: float = 1.0) -> Iterator[str]:
    """The solver on a free 127.0.0.1 port in a background thread; yields its base URL (ending in `/v1`)."""
    with ServerThread(create_app(mental_max, mental_frac)) as url:
        yield f"{url}/v1"
