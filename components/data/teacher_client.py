"""Distillation from a teacher chat endpoint with tool calling: the production path of the SFT data.

`distill` drives an OpenAI-compatible `/chat/completions` endpoint (GPT-OSS-120B behind vLLM; the embedded
stand-in is `components.data.solver_server`) through one conversation per task: the question, then for every
reply with `tool_calls` the code runs in the caller's tool (pass the environment's own `PythonTool`, so the
teacher sees exactly the observation text the RL environment would show), the output goes back as a `tool`
message, and the loop repeats until the teacher answers without a tool call or `max_turns` replies were
spent. The transcript becomes a `Trace` through `trace_from_openai_messages`, so SFT sees one format.

Rejection sampling, as distillation pipelines do: a conversation is kept only when its last boxed answer
grades correct against the task's answer. Every other outcome is counted by reason (`REJECT_REASONS`), never
kept and never fixed:

- `wrong_answer`: the final answer is wrong, or has no `\\boxed{}` at all;
- `max_turns`: the teacher still called the tool on its `max_turns`-th reply;
- `truncated`: a reply stopped at `max_tokens` (`finish_reason == "length"`);
- `bad_tool_call`: a call to another function than `python`, or arguments without a JSON string `code`
  (the student's format cannot express it, so the conversation stops there rather than telling the teacher).

Decisions worth knowing:

- Several calls in one reply (parallel tool calls) are run in order and then split into consecutive
  assistant turns, each followed by its own output (`split_parallel_calls`): the student makes one call per
  turn. Nothing is lost, and a later call in the split trace merely sees more than the teacher did.
- GPT-OSS through vLLM puts its reasoning in `reasoning_content` (or `reasoning`) and may leave `content`
  null on tool-call turns. Null content reads as "". The reasoning is sent back to the endpoint with the
  assistant message (the teacher keeps its chain of thought across tool calls) and kept on the trace's turn
  (`Turn.reasoning`): a student format with a reasoning channel (`hermes`, `<think>`) trains on it, the marker
  format drops it when it renders the trace.
- The grader is a required keyword argument (`grade=components.envs.grading.grade_answer` for tir_math):
  `envs` imports `data`, so `data` importing `envs` would be an import cycle.

Failures of the endpoint itself are errors, not rejections: connection errors, timeouts, HTTP 429 and 5xx
are retried with exponential backoff (`Retry-After` honoured); any other HTTP error, or retries exhausted,
raises `TeacherError` naming the endpoint and the problem id, and `distill` cancels the problems in flight.

`distill` and `distill_task` are synchronous: they run their own asyncio loop (conversations in flight under a
semaphore, tool calls in worker threads), so call them from plain code, not from inside a running loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

import httpx

from components.contracts.task import Task
from components.contracts.trace import Trace
from components.data.traces import trace_from_openai_messages

if TYPE_CHECKING:
    from components.config import DistillConfig

Reason = Literal["accepted", "wrong_answer", "max_turns", "truncated", "bad_tool_call"]
REJECT_REASONS: tuple[Reason, ...] = get_args(Reason)[1:]
"""Why a conversation is not kept (every reason but `accepted`)."""

Tool = Callable[[str], str]
"""`tool(code) -> observation text`, e.g. `components.envs.python_tool.PythonTool`."""
Grade = Callable[[str, int], bool]
"""`grade(final_text, answer) -> correct`, e.g. `components.envs.grading.grade_answer`."""
Progress = Callable[[int, int], None]
"""`progress(done, total)`, called after each task finishes."""

SYSTEM_PROMPT = (
    "Solve the problem. You can run Python with the `python` tool: each call runs a fresh program "
    "and returns what it prints. Give the final answer as \\boxed{integer}."
)
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program in a fresh sandbox and return its stdout (on an error: the last "
        "line of the traceback). Print the values you need.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The complete Python program."}},
            "required": ["code"],
        },
    },
}
_REASONING_FIELDS = ("reasoning_content", "reasoning")
_MAX_BACKOFF_S = 60.0


class TeacherError(RuntimeError):
    """The teacher endpoint failed for a problem (HTTP error, retries exhausted, or a malformed reply)."""

    def __init__(self, url: str, problem_id: str, message: str, status: int | None = None) -> None:
        super().__init__(f"teacher {url} failed on problem {problem_id!r}: {message}")
        self.url, self.problem_id, self.status = url, problem_id, status


@dataclass(frozen=True)
class TeacherEndpoint:
    base_url: str
    """OpenAI-compatible base URL ending in `/v1`; requests go to `{base_url}/chat/completions`."""
    model: str
    """Model name sent with every request."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer <api_key>` when set."""
    temperature: float = 0.0
    """Teacher sampling temperature."""
    max_tokens: int = 4096
    """Completion tokens per reply."""
    timeout_s: float = 300.0
    """Per-request timeout (connect, read, write)."""
    retries: int = 3
    """Retries of a request after a connection error, a timeout, HTTP 429 or 5xx."""
    backoff_s: float = 0.5
    """First retry delay; doubled after each retry (capped at 60 s)."""

    def __post_init__(self) -> None:
        scheme, sep, rest = self.base_url.partition("://")
        if not (sep and scheme in ("http", "https") and rest):
            raise ValueError(f"base_url: must be an http:// or https:// URL, got {self.base_url!r}")
        if not self.model.strip():
            raise ValueError("model: must not be empty")
        for name, value, low in (
            ("temperature", self.temperature, 0),
            ("backoff_s", self.backoff_s, 0),
            ("retries", self.retries, 0),
            ("max_tokens", self.max_tokens, 1),
        ):
            if value < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")

    @classmethod
    def from_config(cls, cfg: DistillConfig, api_key: str | None = None) -> TeacherEndpoint:
        """The endpoint of a `[distill]` config section whose `teacher` is a URL."""
        if cfg.teacher == "programmatic":
            raise ValueError("distill.teacher: is 'programmatic'; a teacher endpoint needs its base URL")
        return cls(cfg.teacher, cfg.model, api_key, cfg.temperature, cfg.max_tokens, cfg.timeout_s, cfg.retries)

    @property
    def url(self) -> str:
        """The chat-completions URL."""
        return self.base_url.rstrip("/") + "/chat/completions"

    def request(self, messages: list[dict]) -> dict:
        """The request body for the next reply of a conversation."""
        return {
            "model": self.model,
            "messages": messages,
            "tools": [PYTHON_TOOL],
            "tool_choice": "auto",
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }


@dataclass(frozen=True)
class DistillOutcome:
    trace: Trace | None
    """The kept trace; None when rejected."""
    messages: list[dict]
    """The conversation as exchanged with the endpoint (system prompt first), for inspection."""
    reason: Reason
    """`accepted`, or why the conversation was rejected."""


@dataclass(frozen=True)
class DistillResult:
    traces: list[Trace]
    """Accepted traces, in the order of the input tasks."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Rejected conversations per reason; every reason of `REJECT_REASONS` is a key."""
    seconds: float = 0.0
    """Wall-clock time of the whole run."""


def distill_task(
    endpoint: TeacherEndpoint, task: Task, tool: Tool, max_turns: int = 8, *, grade: Grade
) -> DistillOutcome:
    """Solve one task with the teacher; raises `TeacherError` when the endpoint fails."""
    return distill_outcomes(endpoint, [task], tool, max_turns, concurrency=1, grade=grade)[0]


def distill(
    endpoint: TeacherEndpoint,
    tasks: Sequence[Task],
    tool: Tool,
    max_turns: int = 8,
    concurrency: int = 16,
    progress: Progress | None = None,
    *,
    grade: Grade,
) -> DistillResult:
    """Distil `tasks` with up to `concurrency` conversations in flight: the accepted traces in input order and
    the rejections counted by reason. Raises `TeacherError` on the first endpoint failure."""
    start = time.perf_counter()
    outcomes = distill_outcomes(endpoint, tasks, tool, max_turns, concurrency, progress, grade=grade)
    rejected = dict.fromkeys(REJECT_REASONS, 0)
    for outcome in outcomes:
        if outcome.trace is None:
            rejected[outcome.reason] += 1
    traces = [o.trace for o in outcomes if o.trace is not None]
    return DistillResult(traces, rejected, time.perf_counter() - start)


def distill_outcomes(
    endpoint: TeacherEndpoint,
    tasks: Sequence[Task],
    tool: Tool,
    max_turns: int = 8,
    concurrency: int = 16,
    progress: Progress | None = None,
    *,
    grade: Grade,
) -> list[DistillOutcome]:
    """Every task's `DistillOutcome`, in input order (what `distill` summarises).

    On the first endpoint failure the conversations in flight are cancelled and the `TeacherError` raised.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns: must be >= 1, got {max_turns}")
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    answers = [_integer_answer(task) for task in tasks]  # refuse bad input before any request
    return asyncio.run(_solve_all(endpoint, list(zip(tasks, answers)), tool, grade, max_turns, concurrency, progress))


def split_parallel_calls(messages: list[dict]) -> list[dict]:
    """The conversation with every multi-call assistant message split into one assistant message per call,
    each followed by its own tool message (matched by `tool_call_id`); the content stays on the first."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        calls = message.get("tool_calls") or []
        if message.get("role") != "assistant" or len(calls) < 2:
            out.append(message)
            i += 1
            continue
        results = messages[i + 1 : i + 1 + len(calls)]
        by_id = {m.get("tool_call_id"): m for m in results if m.get("role") == "tool"}
        for k, call in enumerate(calls):
            if call.get("id") not in by_id:
                raise ValueError(f"messages[{i}].tool_calls[{k}].id: no tool message answers {call.get('id')!r}")
            out.append(
                {"role": "assistant", "content": message.get("content") if k == 0 else None, "tool_calls": [call]}
            )
            out.append(by_id[call["id"]])
        i += 1 + len(calls)
    return out


async def _solve_all(
    endpoint: TeacherEndpoint,
    tasks: list[tuple[Task, int]],
    tool: Tool,
    grade: Grade,
    max_turns: int,
    concurrency: int,
    progress: Progress | None,
) -> list[DistillOutcome]:
    gate = asyncio.Semaphore(concurrency)
    done = 0
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=endpoint.timeout_s, limits=limits, headers=headers) as http:

        async def one(task: Task, answer: int) -> DistillOutcome:
            nonlocal done
            async with gate:
                outcome = await _solve(http, endpoint, task, answer, tool, grade, max_turns)
            done += 1
            if progress is not None:
                progress(done, len(tasks))
            return outcome

        running = [asyncio.create_task(one(task, answer)) for task, answer in tasks]
        try:
            return await asyncio.gather(*running)
        except BaseException:
            for pending in running:
                pending.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            raise


async def _solve(
    http: httpx.AsyncClient,
    endpoint: TeacherEndpoint,
    task: Task,
    answer: int,
    tool: Tool,
    grade: Grade,
    max_turns: int,
) -> DistillOutcome:
    """One conversation: ask, run the calls, ask again; then grade the final answer."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}]
    for _ in range(max_turns):
        data = await _post(http, endpoint, endpoint.request(messages), task.task_id)
        message, finish_reason = _reply(data, endpoint.url, task.task_id)
        calls = message.get("tool_calls") or []
        messages.append(_assistant_message(message, calls))
        if finish_reason == "length":
            return DistillOutcome(None, messages, "truncated")
        if not calls:
            if not grade(message.get("content") or "", answer):
                return DistillOutcome(None, messages, "wrong_answer")
            trace = trace_from_openai_messages(task.task_id, split_parallel_calls(messages), answer)
            return DistillOutcome(trace, messages, "accepted")
        codes = [_call_code(call) for call in calls]
        if any(code is None for code in codes):
            return DistillOutcome(None, messages, "bad_tool_call")
        for k, call in enumerate(calls):
            if not isinstance(call.get("id"), str):
                raise TeacherError(endpoint.url, task.task_id, f"choices[0].message.tool_calls[{k}].id: missing")
        for call, code in zip(calls, codes):
            output = await asyncio.to_thread(tool, code)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    return DistillOutcome(None, messages, "max_turns")


async def _post(http: httpx.AsyncClient, endpoint: TeacherEndpoint, body: dict, problem_id: str) -> dict:
    """POST with retries on connection errors, timeouts, 429 and 5xx; `TeacherError` on anything else."""
    delay = endpoint.backoff_s
    for attempt in range(endpoint.retries + 1):
        last_try = attempt == endpoint.retries
        try:
            response = await http.post(endpoint.url, json=body)
        except httpx.TransportError as exc:
            if last_try:
                raise TeacherError(
                    endpoint.url, problem_id, f"{type(exc).__name__}: {exc} (after {attempt + 1} attempts)"
                ) from exc
            await asyncio.sleep(delay)
            delay = min(2 * delay, _MAX_BACKOFF_S)
            continue
        status = response.status_code
        if status < 400:
            try:
                return response.json()
            except ValueError as exc:
                raise TeacherError(endpoint.url, problem_id, f"reply is not JSON: {response.text[:200]!r}") from exc
        retryable = status == 429 or status >= 500
        if not retryable or last_try:
            tries = f" (after {attempt + 1} attempts)" if retryable else ""
            raise TeacherError(endpoint.url, problem_id, f"HTTP {status}: {_error_message(response)}{tries}", status)
        await asyncio.sleep(max(delay, _retry_after(response)))
        delay = min(2 * delay, _MAX_BACKOFF_S)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _reply(data: dict, url: str, problem_id: str) -> tuple[dict, str | None]:
    """(choices[0].message, choices[0].finish_reason) of a reply; `TeacherError` naming a missing field."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise TeacherError(url, problem_id, "reply has no choices[0]") from exc
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise TeacherError(url, problem_id, "reply has no choices[0].message")
    return message, choice.get("finish_reason")


def _assistant_message(message: dict, calls: list[dict]) -> dict:
    """The reply as the next request's assistant message: content, calls and the reasoning fields."""
    out = {"role": "assistant", "content": message.get("content")}
    if calls:
        out["tool_calls"] = calls
    out.update({name: message[name] for name in _REASONING_FIELDS if message.get(name)})
    return out


def _call_code(call: dict) -> str | None:
    """The `code` argument of a `python` call; None for another function or malformed arguments."""
    function = call.get("function") or {}
    if function.get("name") != "python":
        return None
    try:
        code = json.loads(function.get("arguments") or "")["code"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def _integer_answer(task: Task) -> int:
    """The task's reference answer as an int (JSONL sets may hold "42"); ValueError naming the task."""
    bad = isinstance(task.answer, bool) or (isinstance(task.answer, float) and not task.answer.is_integer())
    try:
        answer = int(task.answer)
    except (TypeError, ValueError):
        bad = True
    if bad:
        raise ValueError(f"task {task.task_id}: answer must be an integer, got {task.answer!r}")
    return answer


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return response.text[:500]
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return response.text[:500]


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(float(response.headers.get("retry-after", 0)), _MAX_BACKOFF_S)
    except ValueError:
        return 0.0
