"""`POST /v1/chat/completions` on the embedded engine's server: OpenAI's chat API over the sampling path of
`/v1/completions` (components/rollout/sampling.py), with the token ids a trainer needs.

- The messages and tools become prompt ids through the model's chat format, as the agent runner builds an
  episode (components/chat/messages.py), and the sampled turn is parsed by the same format (`ChatFormat.parse`)
  into `message.content`, `message.reasoning_content` (a `<think>` block, when there is one) and at most one
  `message.tool_calls` entry (`id`, `type: function`, `function.name`, `function.arguments` as a JSON string);
  `finish_reason` is `tool_calls`, `stop` or `length`.
- Token in, token out: the response always has `prompt_token_ids` at the top and `token_ids` in the choice (vLLM's
  names for what it returns with `return_token_ids`), each token's policy version in `versions` (as on
  `/v1/completions`) and, with `logprobs: true`, each token's log-prob in OpenAI's shape (`logprobs.content[i]`
  with `token`, `logprob`, `bytes`, `top_logprobs`): the sampling distribution's, temperature applied, untruncated.
- `stream: true` sends OpenAI's `chat.completion.chunk` events: `prompt_token_ids` in the first (as vLLM), then
  one per token as the engine samples it (its `token_ids`, `versions` and log-prob), then the turn's end (the
  tool call, `finish_reason`), the usage when `stream_options.include_usage`, and `data: [DONE]`. Content is sent
  once the format has settled it (`SettledContent`), so the deltas add up to the non-streamed `content`; the
  tokens are the same for the same seed.

Departures from OpenAI, each refused with 400 naming the field rather than ignored: n = 1 only; top_p must be 1
and top_logprobs 0 (truncated sampling would break the IS ratio, and the engine returns the sampled token's
log-prob only); tool_choice `auto` or `none` (a forced call needs constrained decoding); one tool call per turn;
a conversation in an episode's shape. With `tool_choice: none` or no tools offered, a call the model writes
anyway is not returned as one (the content is the prose before it); a malformed call neither, and the choice's
`call_error` says why. A stop string is dropped from the content (the token ids keep it). `max_tokens` (or
`max_completion_tokens`) defaults to what the context leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from components.chat.format import ChatFormat, FormatError
from components.chat.messages import check_tools, conversation_ids
from components.rollout.embedded import EmbeddedEngine
from components.rollout.protocol import SamplingRequest, SamplingResult
from components.rollout.sampling import BadRequest, CompletionRequest, sample, sampling_request, submit
from components.tracking.prometheus import EngineMetrics


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    """Send the usage in one more chunk (with no choices) before `[DONE]`."""


class ChatRequest(BaseModel):
    """The chat request's fields; `messages` and `tools` are checked by components/chat/messages.py, which names
    the message and field it refuses."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[Any]
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, allow_inf_nan=False)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    return_token_ids: bool | None = None
    """Accepted for vLLM's clients; the token ids are always returned."""
    user: str | None = None


@dataclass(frozen=True)
class Reply:
    """A sampled turn as the chat API returns it."""

    content: str
    reasoning: str | None
    call: dict[str, Any] | None
    """The OpenAI tool call, or None."""
    call_error: str | None
    """Why a call the model wrote could not be parsed (None: there was none, or it parsed)."""
    finish_reason: str
    stop_reason: int | str | None
    """The stop token id or stop string the turn ended on (vLLM's field)."""


def add_chat_route(
    app: FastAPI, engine: EmbeddedEngine, model_name: str, served: EngineMetrics, chat: ChatFormat | FormatError
) -> None:
    """Register `POST /v1/chat/completions`; `chat` is the model's format, or why it has none (then every chat
    request is refused naming the model, and `/v1/completions` still serves token ids)."""

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatRequest) -> dict | StreamingResponse:
        if isinstance(chat, FormatError):
            raise BadRequest("model", f"model: {model_name!r} has no chat format to render messages in: {chat}")
        request, tools_on = chat_request(body, chat, model_name, engine.max_model_len)
        if body.stream:
            return _stream(body, chat, engine, served, request, tools_on, model_name)
        with _named_for_chat(body):
            result = await sample(engine, served, request)
        return chat_completion(body, chat, result, read_reply(chat, result, request.stop, tools_on), model_name)


def chat_request(body: ChatRequest, chat: ChatFormat, model_name: str, context: int) -> tuple[SamplingRequest, bool]:
    """The engine request `body` asks for, and whether a tool call is returned as one."""
    if body.top_logprobs:
        raise BadRequest("top_logprobs", "top_logprobs: must be 0 (the engine returns the sampled token's only)")
    if body.tool_choice not in (None, "auto", "none"):
        raise BadRequest("tool_choice", "tool_choice: only 'auto' and 'none' are supported (no forced calls)")
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise BadRequest("max_tokens", "max_tokens: send max_tokens or max_completion_tokens, not both")
    try:
        tools = check_tools(chat, body.tools)
        prompt = conversation_ids(chat, body.messages, tools)
    except ValueError as exc:
        raise BadRequest(_field(exc), str(exc)) from exc
    max_tokens = body.max_completion_tokens or body.max_tokens or context - len(prompt)
    if max_tokens < 1:
        raise BadRequest("messages", f"messages: the prompt's {len(prompt)} tokens fill the context length {context}")
    completion = CompletionRequest.model_construct(
        model=body.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=-1,
        n=body.n,
        stop=body.stop,
        stop_token_ids=list(chat.stop_token_ids),
        seed=body.seed,
    )
    with _named_for_chat(body):
        request = sampling_request(completion, model_name)
    return request, bool(tools) and body.tool_choice != "none"


def _field(exc: ValueError) -> str:
    """The field a checker's message starts with (`messages[2].role: ...`)."""
    return str(exc).split(": ", 1)[0]


@contextlib.contextmanager
def _named_for_chat(body: ChatRequest):
    """A refusal of the shared sampling path named by the chat request's fields: the prompt is the messages, and
    the token limit whichever of max_tokens and max_completion_tokens was sent."""
    names = {
        "prompt": "messages",
        "max_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
    }
    try:
        yield
    except BadRequest as exc:
        name = names.get(exc.param, exc.param)
        message = str(exc)
        raise BadRequest(name, name + message[len(exc.param) :] if message.startswith(exc.param) else message) from exc


def read_reply(chat: ChatFormat, result: SamplingResult, stops: tuple[str, ...], tools_on: bool) -> Reply:
    """The format's parse of the sampled turn as the chat API returns it."""
    text = decode(chat, result.token_ids)
    turn = chat.parse(text, result.finish_reason == "length")
    content, stop_reason = turn.content, None
    if result.finish_reason == "stop" and result.token_ids:
        if result.token_ids[-1] in chat.stop_token_ids:
            stop_reason = result.token_ids[-1]
        else:  # a stop string ended the turn: OpenAI leaves it out of the content
            stop_reason = next((s for s in stops if text.endswith(s)), None)
            if stop_reason and content.endswith(stop_reason):
                content = content[: -len(stop_reason)]
    if turn.call is not None and tools_on:
        arguments = json.dumps(turn.call.arguments, ensure_ascii=False)
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
        call["function"] = {"name": turn.call.name, "arguments": arguments}
        return Reply(content, turn.reasoning, call, None, "tool_calls", stop_reason)
    return Reply(content, turn.reasoning, None, turn.call_error, result.finish_reason, stop_reason)


def decode(chat: ChatFormat, ids: list[int]) -> str:
    """Exactly what was sampled, special tokens included, as the agent runner decodes a turn."""
    return chat.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def logprob_entries(chat: ChatFormat, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` for the sampled tokens (no alternatives: `top_logprobs` is empty)."""
    entries = []
    for token, logprob in zip(ids, logprobs):
        text = decode(chat, [token])
        entries.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
    return entries


def _usage(result: SamplingResult) -> dict[str, int]:
    n_prompt, n_out = len(result.prompt_ids), len(result.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def chat_completion(body: ChatRequest, chat: ChatFormat, result: SamplingResult, reply: Reply, model: str) -> dict:
    """The `chat.completion` object, with the token ids, versions and parse error as extra fields."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.call else "")}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.call is not None:
        message["tool_calls"] = [reply.call]
    choice = {
        "index": 0,
        "message": message,
        "logprobs": {"content": logprob_entries(chat, result.token_ids, result.logprobs)} if body.logprobs else None,
        "finish_reason": reply.finish_reason,
        "stop_reason": reply.stop_reason,
        "token_ids": result.token_ids,
        "versions": result.versions,
    }
    if reply.call_error is not None:
        choice["call_error"] = reply.call_error
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(result),
        "prompt_token_ids": result.prompt_ids,
    }


class SettledContent:
    """The content a stream may send before its turn ends: the longest text the format's parse gives as content
    for the tokens so far and would still give whichever of its markup strings came next (a `</think>` that makes
    the text reasoning, a `<tool_call>` or `<|python|>` that starts a call). A suffix that may be the start of a
    markup or stop string is held back. The deltas sent therefore add up to a prefix of the final content."""

    def __init__(self, chat: ChatFormat, stops: tuple[str, ...]) -> None:
        self.chat, self.held, self.sent = chat, (*chat.markup, *stops), ""

    def delta(self, text: str) -> str:
        """The new content `text` (the turn so far) settles."""
        text = _without_partial(text, self.held)
        futures = [self.chat.parse(text, True).content]
        futures += [self.chat.parse(text + mark, False).content for mark in self.chat.markup]
        settled = os.path.commonprefix(futures)
        if len(settled) <= len(self.sent) or not settled.startswith(self.sent):
            return ""
        piece, self.sent = settled[len(self.sent) :], settled
        return piece

    def rest(self, content: str) -> str:
        """What of the final `content` is still to be sent."""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""


def _without_partial(text: str, strings: tuple[str, ...]) -> str:
    """`text` less its longest suffix that is the start of one of `strings`."""
    for k in range(min(len(text), max(map(len, strings), default=0)), 0, -1):
        if any(s.startswith(text[-k:]) for s in strings):
            return text[:-k]
    return text


def _stream(
    body: ChatRequest,
    chat: ChatFormat,
    engine: EmbeddedEngine,
    served: EngineMetrics,
    request: SamplingRequest,
    tools_on: bool,
    model: str,
) -> StreamingResponse:
    """Submit `request` now (so a refusal is still a 400) and stream its tokens as the engine samples them."""
    loop, tokens = asyncio.get_running_loop(), asyncio.Queue()

    def put(item: tuple[int, float, int] | None) -> None:  # on the engine's thread
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutting down): nobody is listening
            loop.call_soon_threadsafe(tokens.put_nowait, item)

    with _named_for_chat(body):
        future = submit(engine, request, lambda *token: put(token))
    future.add_done_callback(lambda _: put(None))  # after every token: the engine tells each before resolving
    events = _events(body, chat, request, tools_on, model, tokens, future, served)
    return StreamingResponse(events, media_type="text/event-stream")


async def _events(
    body: ChatRequest,
    chat: ChatFormat,
    request: SamplingRequest,
    tools_on: bool,
    model: str,
    tokens: asyncio.Queue,
    future: Future,
    served: EngineMetrics,
) -> AsyncIterator[str]:
    """The SSE events of one streamed turn, ending `data: [DONE]`: `tokens` gets each sampled token, then None
    once `future` (the engine's answer) is resolved."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time())}
    head["model"] = model

    def chunk(delta: dict, **extra) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
        return _sse({**head, "choices": [choice]})

    yield _sse({**head, "choices": [_first_choice()], "prompt_token_ids": request.prompt_ids})
    ids, content = [], SettledContent(chat, request.stop)
    while (item := await tokens.get()) is not None:
        token, logprob, version = item
        ids.append(token)
        piece = content.delta(decode(chat, ids))
        logprobs = {"content": logprob_entries(chat, [token], [logprob])} if body.logprobs else None
        yield chunk({"content": piece} if piece else {}, logprobs=logprobs, token_ids=[token], versions=[version])
    try:
        result = future.result()
    except Exception as exc:  # the engine failed mid-stream: the status line is sent, so the error is an event
        yield _sse({"error": {"message": f"engine: {exc}", "type": "InternalServerError", "param": None, "code": 500}})
        yield "data: [DONE]\n\n"
        return
    served.request_done()
    reply = read_reply(chat, result, request.stop, tools_on)
    yield chunk(_last_delta(reply, content), finish_reason=reply.finish_reason, stop_reason=reply.stop_reason)
    if body.stream_options is not None and body.stream_options.include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(result)})
    yield "data: [DONE]\n\n"


def _first_choice() -> dict:
    return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def _last_delta(reply: Reply, content: SettledContent) -> dict:
    """The rest of the content, the reasoning and the tool call, sent when the turn has ended."""
    delta: dict[str, Any] = {}
    if rest := content.rest(reply.content):
        delta["content"] = rest
    if reply.reasoning is not None:
        delta["reasoning_content"] = reply.reasoning
    if reply.call is not None:
        delta["tool_calls"] = [{"index": 0, **reply.call}]
    return delta


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
