"""The sampling path every OpenAI route of the engine server shares (components/rollout/server.py): a completion
body read into one `SamplingRequest`, refusals named by field, and the engine's answer counted.

`/v1/completions` and `/v1/chat/completions` (components/rollout/chat_api.py) both go through
`sampling_request` and `submit`, so the checks that keep logged log-probs equal to the sampling distribution
(n = 1, no top_p/top_k truncation) and the engine's own checks (context length, vocabulary) hold for both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from components.rollout.embedded import EmbeddedEngine
from components.rollout.protocol import SamplingRequest, SamplingResult
from components.tracking.prometheus import EngineMetrics


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: list[StrictInt] | str
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, allow_inf_nan=False)
    top_k: int = -1
    n: int = 1
    logprobs: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: int | None = None
    return_token_ids: bool = False


class BadRequest(Exception):
    """A request the server refuses with HTTP 400; `param` names the field (the OpenAI error's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def sampling_request(body: CompletionRequest, model_name: str, tokenizer=None) -> SamplingRequest:
    """The engine request a parsed completion body asks for; `BadRequest` names the field it refuses."""
    if body.model is not None and body.model != model_name:
        raise BadRequest("model", f"model: {body.model!r} is not served here (serving {model_name!r})")
    if body.n != 1:
        raise BadRequest("n", "n: only n=1 is supported (one rollout per prompt)")
    if body.top_p != 1.0 or body.top_k not in (-1, 0):
        param = "top_p" if body.top_p != 1.0 else "top_k"
        raise BadRequest(
            param, f"{param}: truncated sampling is refused during RL (the IS ratio needs the full distribution)"
        )
    prompt = body.prompt
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest("prompt", "prompt: this engine has no tokenizer; send token ids")
        prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingRequest(
            list(prompt), body.max_tokens, body.temperature, tuple(body.stop_token_ids or ()), stop, body.seed
        )
    except ValueError as exc:
        raise BadRequest(str(exc).split(":", 1)[0], str(exc)) from exc


TokenSink = Callable[[int, float, int], None]
"""Called with (token id, log-prob, version) for each token as the engine samples it, on the engine's thread."""


def submit(engine: EmbeddedEngine, request: SamplingRequest, on_token: TokenSink | None = None) -> Future:
    """Queue `request` on the engine; the engine's refusals (context length, vocabulary) become `BadRequest`
    before anything is sampled, so a streamed response can still answer 400."""
    try:
        return engine.submit(request, on_token)
    except ValueError as exc:
        raise BadRequest(str(exc).split(":", 1)[0], str(exc)) from exc


async def sample(engine: EmbeddedEngine, served: EngineMetrics, request: SamplingRequest) -> SamplingResult:
    """One sampled completion of `request`, counted as a served request."""
    result = await asyncio.wrap_future(submit(engine, request))
    served.request_done()
    return result
