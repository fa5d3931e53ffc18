"""Async client for OpenAI-compatible completion servers: the embedded server and `vllm serve` alike.

vLLM must be started with `--logprobs-mode processed_logprobs`. Its default, `raw_logprobs`, ignores the
temperature, and DIS would then divide by the wrong distribution (docs/design.md section 7). vLLM does not return
per-token versions, so for vLLM every token of a response is tagged with the version the client last
published (`default_version`). Weight publishing differs between the two servers:

- the embedded server: `POST /v1/weights`;
- vLLM: the dev-mode `POST /collective_rpc`, which calls the worker extension in
  `components.rollout.vllm_worker`.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import httpx

from components.rollout.protocol import SamplingRequest, SamplingResult

_RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ConnectTimeout)


class EngineError(RuntimeError):
    """The server answered with an error (the message is the server's)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"engine returned HTTP {status}: {message}")
        self.status = status


class EngineClient:
    """`generate` and `publish_weights` over HTTP, with retries on connection errors and a request timeout."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        timeout_s: float = 300.0,
        retries: int = 3,
        backend: Literal["embedded", "vllm"] = "embedded",
        default_version: int = 0,
        max_connections: int = 256,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.retries = retries
        self.backend = backend
        self.default_version = default_version
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, limits=limits)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def generate(self, request: SamplingRequest) -> SamplingResult:
        body = {
            "prompt": request.prompt_ids,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "logprobs": 1,
            "return_token_ids": True,
            "top_p": 1.0,
            "top_k": -1,
        }
        if self.model:
            body["model"] = self.model
        if request.stop:
            body["stop"] = list(request.stop)
        if request.stop_token_ids:
            body["stop_token_ids"] = list(request.stop_token_ids)
        if request.seed is not None:
            body["seed"] = request.seed
        if self.backend == "vllm":
            # vLLM drops stop tokens from the output unless asked; the trajectory needs them as action tokens.
            body["include_stop_str_in_output"] = True
            body["skip_special_tokens"] = False
        data = await self._post("/v1/completions", body)
        return parse_completion(data, request.prompt_ids, self.default_version)

    async def publish_weights(self, path: str, version: int, rewind: bool = False) -> None:
        """Load the weights at `path` as `version`; `rewind` lets the embedded server go back to a version not
        above the one it serves (vLLM keeps no version, so it needs no flag)."""
        if self.backend == "vllm":
            await self._post("/collective_rpc", {"method": "sao_reload_weights", "kwargs": {"path": path}})
            await self._post("/reset_prefix_cache", {})
        else:
            body = {"path": path, "version": version}
            if rewind:  # sent only when set: a server that predates the flag refuses unknown fields
                body["rewind"] = True
            await self._post("/v1/weights", body)
        self.default_version = version

    async def health(self) -> bool:
        return await self.health_info() is not None

    async def health_info(self, timeout_s: float = 5.0) -> dict | None:
        """The `/health` JSON (`{}` when the body is empty, as vLLM's is), or None when the server does not
        answer 200 within `timeout_s`."""
        try:
            return health_json(await self._http.get("/health", timeout=timeout_s))
        except httpx.HTTPError:
            return None

    async def _post(self, route: str, body: dict) -> dict:
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                response = await self._http.post(route, json=body)
            except _RETRYABLE:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(delay)
                delay *= 2
                continue
            if response.status_code >= 400:
                try:
                    message = response.json().get("error", {}).get("message") or response.text
                except ValueError:
                    message = response.text
                raise EngineError(response.status_code, message)
            return response.json() if response.content else {}
        raise AssertionError("unreachable")


def health_json(response: httpx.Response) -> dict | None:
    """A `/health` answer as JSON: None unless HTTP 200, `{}` for an empty or non-JSON body (vLLM's)."""
    if response.status_code != 200:
        return None
    try:
        data = response.json() if response.content else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def server_failed(exc: BaseException) -> bool:
    """True when `exc` says the server is dead, hung or crashing (connection error, timeout, HTTP 5xx): the
    same stateless request may then go to another server. False for the caller's own mistakes (HTTP 4xx), a
    malformed answer, and a full client connection pool (a client-side limit, not the server's fault)."""
    if isinstance(exc, EngineError):
        return exc.status >= 500
    return isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.PoolTimeout)


def parse_completion(data: dict, prompt_ids: list[int], default_version: int) -> SamplingResult:
    """vLLM-shaped completion JSON -> `SamplingResult`; a missing or inconsistent field is an error naming it."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError("response: no choices[0]") from exc
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise ValueError("choices[0].token_ids: missing (the server must support return_token_ids)")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if logprobs is None or len(logprobs) != len(token_ids):
        raise ValueError(
            f"choices[0].logprobs.token_logprobs: expected {len(token_ids)} values, got "
            f"{None if logprobs is None else len(logprobs)}"
        )
    versions = choice.get("versions") or [default_version] * len(token_ids)
    if len(versions) != len(token_ids):
        raise ValueError(f"choices[0].versions: expected {len(token_ids)} values, got {len(versions)}")
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length", "abort"):
        raise ValueError(f"choices[0].finish_reason: unexpected value {reason!r}")
    return SamplingResult(list(token_ids), [float(x) for x in logprobs], list(versions), reason, prompt_ids)
