"""Async client for OpenAI-compatible completion servers: the embedded server and `vllm serve` alike.

vLLM must be started with `--logprobs-mode processed_logprobs`. Its default, `raw_logprobs`, ignores the
temperature, and DIS would then divide by the wrong distribution (docs/design.md section 7). Weight updates
differ between the two servers, and so does what a token's version means:

- `sao engine serve` (backend="embedded"): `POST /v1/weights` (a directory) or `/v1/weights/group` +
  `/v1/weights/receive` (the collective transport, components/rollout/transfer.py). The server loads new weights
  between two decode steps, recomputes the KV cache of the requests in flight, continues them, and tags each
  token with the version that sampled it; a response can hold several versions.
- vLLM (backend="vllm"): the same calls go through the dev-mode `POST /collective_rpc` to the worker extension
  in `components.rollout.vllm_worker` (`sao_reload_weights`, `sao_join_group`, `sao_receive_weights`), then
  `POST /reset_prefix_cache`. vLLM returns no per-token versions and reloads under running requests, so an update
  goes through this client's gate (components/rollout/gate.py): new `generate` calls are held while it is
  pending, and the load waits until this client's requests in flight have left. With `update_mode="continue"`
  (the default) they leave at once: each request is streamed, and when an update comes the client stops reading
  (vLLM aborts a request whose client disconnected), keeps the tokens and log-probs read so far, tagged with the
  version loaded when that part was sent, and once the load is done sends the prompt plus those tokens for the
  rest of the budget (vLLM recomputes their KV cache on the new weights: a prefill), tagging the new tokens with
  the new version. The answer is one `SamplingResult` whose `versions` may hold several versions, as the
  embedded engine's do. A request with stop strings is not resumed (a stop string spanning the two parts would
  be missed): it is drained. With `update_mode="drain"` every request is answered before the load, so an update
  costs the time of the longest request in flight. Requests of other clients of the same server are not held
  (the trainer's rollouts must be the only ones on it).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from dataclasses import dataclass, field
from typing import Literal, get_args

import httpx

from components.rollout.access import bearer
from components.rollout.gate import VersionGate
from components.rollout.protocol import FinishReason, SamplingRequest, SamplingResult

_RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ConnectTimeout)
_LOADS = ("sao_reload_weights", "sao_receive_weights")  # the worker methods whose success changed the weights


class EngineError(RuntimeError):
    """The server answered with an error (the message is the server's)."""

    def __init__(self, status: int, message: str, weights_unchanged: bool = False) -> None:
        super().__init__(f"engine returned HTTP {status}: {message}")
        self.status = status
        self.weights_unchanged = weights_unchanged
        """The server refused a weight update before it touched its weights (components/rollout/gate.py)."""


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
        weights_token: str | None = None,
        api_key: str | None = None,
        update_mode: Literal["continue", "drain"] = "continue",
    ) -> None:
        """`weights_token` goes with the weight routes, `api_key` with the completions (components/rollout/access.py).
        vLLM has one key, its `--api-key`, for whatever it guards, so its weight routes get `api_key` too (0.32
        guards only `/v1`, but a vLLM that also guards its dev routes wants that key there, not ours)."""
        self.base_url = base_url.rstrip("/")
        self._api_headers = bearer(api_key)
        self._weights_headers = self._api_headers if backend == "vllm" else bearer(weights_token)
        self.model = model
        self.retries = retries
        self.backend = backend
        self.update_mode = update_mode
        """What an update does to the requests in flight (`rollout.update_mode`; module docstring)."""
        # vLLM's requests and updates go through it (module docstring)
        self._gate = VersionGate(default_version, preempts=update_mode == "continue")
        self._group: str | None = None  # vLLM: the transfer group this client formed with the server
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, limits=limits)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def default_version(self) -> int:
        """The version this client last loaded: what a token without a version of its own is tagged with."""
        return self._gate.version

    @default_version.setter
    def default_version(self, version: int) -> None:
        self._gate.version = version

    @property
    def updating(self) -> bool:
        """A vLLM weight update is pending or loading: new `generate` calls wait for it (module docstring)."""
        return self._gate.pending > 0

    @property
    def draining(self) -> bool:
        """A vLLM weight update waits for this client's requests in flight: the server has not been asked yet (a
        transport's deadline for the server's answer should not run meanwhile)."""
        return self._gate.draining

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
            if self.update_mode == "continue" and not request.stop:
                return await self._continued(request, body)
            async with self._gate.request() as version:  # held while an update is pending
                data = await self._post("/v1/completions", body, self._api_headers)
            return parse_completion(data, request.prompt_ids, version)
        data = await self._post("/v1/completions", body, self._api_headers)
        return parse_completion(data, request.prompt_ids, self.default_version)

    async def _continued(self, request: SamplingRequest, body: dict) -> SamplingResult:
        """vLLM, continue mode: the request streamed in parts, each sent through the gate with the tokens so far
        appended to the prompt, until one ends (module docstring)."""
        out = _Parts()
        while True:
            async with self._gate.request() as version:  # held while an update is pending
                preempt = self._gate.preempt  # taken on entering: the next update sets it
                left = request.max_tokens - len(out.token_ids)
                if left <= 0:  # every token came, the finish reason did not: the budget is what ended it
                    return SamplingResult(out.token_ids, out.logprobs, out.versions, "length", request.prompt_ids)
                part = {**body, "prompt": request.prompt_ids + out.token_ids, "max_tokens": left, "stream": True}
                if out.token_ids and request.seed is not None:  # a fresh draw for the rest, not the first part's again
                    part["seed"] = (request.seed + len(out.token_ids)) % 2**63
                reason = await _until(self._stream(part, out, version), preempt)
            if reason is not None:
                return SamplingResult(out.token_ids, out.logprobs, out.versions, reason, request.prompt_ids)
            out.parts += 1

    async def _stream(self, body: dict, out: _Parts, version: int) -> str:
        """Stream one completion, appending each chunk's tokens to `out` (tagged `version`) as it arrives; returns
        the finish reason. A connection that fails before any token came is retried as `_post` does; after, the
        error is raised (sending the same body again would sample those tokens twice)."""
        delay, before = 0.2, len(out.token_ids)
        for attempt in range(self.retries + 1):
            try:
                async with self._http.stream("POST", "/v1/completions", json=body, headers=self._api_headers) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        raise EngineError(r.status_code, _error_message(r))
                    async for line in r.aiter_lines():
                        reason = out.add(line, version)
                        if reason is not None:
                            return reason
                raise EngineError(502, "completion stream: ended without a finish_reason")
            except _RETRYABLE:
                if attempt == self.retries or len(out.token_ids) > before:
                    raise
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def publish_weights(self, path: str, version: int, rewind: bool = False) -> None:
        """Load the weights at `path` as `version`; `rewind` lets the embedded server go back to a version not
        above the one it serves (vLLM keeps no version, so it needs no flag)."""
        if self.backend == "vllm":
            await self._update(version, "sao_reload_weights", {"path": path})
            return
        body = {"path": path, "version": version}
        if rewind:  # sent only when set: a server that predates the flag refuses unknown fields
            body["rewind"] = True
        if self.update_mode == "drain":  # likewise
            body["drain"] = True
        await self._post("/v1/weights", body, self._weights_headers)
        self.default_version = version

    async def join_group(self, body: dict) -> dict:
        """Ask the server to join a weight-transfer group (components/rollout/transfer.py); returns once it has.
        vLLM's engine stops stepping while its worker joins (the rpc blocks it), its weights untouched."""
        if self.backend == "vllm":
            self._group = None
            data = await self._rpc("sao_join_group", body)
            self._group = data.get("transfer_group")
            return data
        return await self._post("/v1/weights/group", body, self._weights_headers)

    async def receive_weights(self, body: dict) -> dict:
        """Ask the server to receive the buckets the trainer broadcasts next, and load them as `body["version"]`.
        On vLLM the post waits for this client's requests in flight first (the server sets the ready key only
        then), and new requests wait for the load (module docstring)."""
        if self.backend == "vllm":
            try:
                return await self._update(body["version"], "sao_receive_weights", body)
            except BaseException:
                self._group = None  # maybe gone with the server (a restart): the next transfer forms a new one
                raise
        if self.update_mode == "drain":
            body = {**body, "drain": True}
        data = await self._post("/v1/weights/receive", body, self._weights_headers)
        self.default_version = body["version"]
        return data

    async def health(self) -> bool:
        return await self.health_info() is not None

    async def health_info(self, timeout_s: float = 5.0) -> dict | None:
        """The `/health` JSON (`{}` when the body is empty, as vLLM's is), or None when the server does not
        answer 200 within `timeout_s`. vLLM's says nothing of a transfer group, so for vLLM `transfer_group` is the
        group this client last formed with the server (none once a transfer failed): a restarted server's worker
        refuses it with HTTP 409, and the transport forms a new one."""
        try:
            info = health_json(await self._http.get("/health", timeout=timeout_s))
        except httpx.HTTPError:
            return None
        if info is not None and self.backend == "vllm":
            info.setdefault("transfer_group", self._group)
        return info

    async def _update(self, version: int, method: str, kwargs: dict) -> dict:
        """vLLM: load weights as `version` through the worker extension's `method`, then drop the prefix cache, as
        one update of the gate (components/rollout/gate.py)."""

        async def load() -> dict:
            data = await self._rpc(method, kwargs)
            await self._reset_prefix_cache()
            return data

        return await self._gate.update(version, load)

    async def _rpc(self, method: str, kwargs: dict) -> dict:
        """Call the worker extension's `method` on every vLLM worker; its answer (the first worker's), or EngineError
        with the worker's message when one refused (`{"error", "param", "status", "weights_unchanged"}`)."""
        data = await self._post("/collective_rpc", {"method": method, "kwargs": kwargs}, self._weights_headers)
        results = data.get("results")
        if not isinstance(results, list) or not results:
            raise EngineError(502, f"collective_rpc {method}: expected a list of results, got {data!r:.200}")
        refused = [r for r in results if isinstance(r, dict) and "error" in r]  # one result per worker
        if refused:  # unchanged only where no worker's weights changed: a worker that loaded leaves the shards mixed
            loaded = len(refused) < len(results) and method in _LOADS
            unchanged = not loaded and all(bool(r.get("weights_unchanged")) for r in refused)
            raise EngineError(refused[0].get("status", 400), refused[0]["error"], weights_unchanged=unchanged)
        return results[0] if isinstance(results[0], dict) else {"result": results[0]}

    async def _reset_prefix_cache(self, attempts: int = 20) -> None:
        """Drop vLLM's prefix cache (KV of the old weights). vLLM refuses (`success: false`) while blocks are held,
        e.g. by requests another client has running: retried for about a second, then EngineError 503."""
        for _ in range(attempts):
            data = await self._post("/reset_prefix_cache", {}, self._weights_headers)
            if data.get("success", True):
                return
            await asyncio.sleep(0.05)
        raise EngineError(503, "reset_prefix_cache: vLLM kept its prefix cache (its KV blocks are still held)")

    async def _post(self, route: str, body: dict, headers: dict[str, str]) -> dict:
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                response = await self._http.post(route, json=body, headers=headers)
            except _RETRYABLE:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(delay)
                delay *= 2
                continue
            if response.status_code >= 400:
                raise EngineError(response.status_code, _error_message(response))
            return response.json() if response.content else {}
        raise AssertionError("unreachable")


def _error_message(response: httpx.Response) -> str:
    """The server's error message in an error response (OpenAI's `{"error": {"message"}}`, else the body)."""
    try:
        return response.json().get("error", {}).get("message") or response.text
    except (ValueError, AttributeError):
        return response.text


@dataclass
class _Parts:
    """A continued vLLM request's tokens so far, over its parts (`EngineClient._continued`)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    parts: int = 1

    def add(self, line: str, version: int) -> str | None:
        """One server-sent-events line of a completion stream: its tokens appended, tagged `version`; returns the
        finish reason once a chunk carries one. A chunk's tokens are appended whole or not at all."""
        if not line.startswith("data:"):
            return None
        payload = line[5:].strip()
        if payload == "[DONE]":
            return None
        data = json.loads(payload)
        if "error" in data:  # vLLM reports a failure inside the stream
            error = data["error"]
            raise EngineError(int(error.get("code") or 500), error.get("message") or str(error))
        reason = None
        for choice in data.get("choices") or []:
            ids = choice.get("token_ids") or []
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if len(logprobs) != len(ids):
                raise ValueError(
                    f"choices[0].logprobs.token_logprobs: expected {len(ids)} values in a stream chunk, got "
                    f"{len(logprobs)} (the server must support return_token_ids)"
                )
            self.token_ids += ids
            self.logprobs += [float(x) for x in logprobs]
            self.versions += [version] * len(ids)
            reason = choice.get("finish_reason") or reason
        return reason if reason is None else finish_reason(reason)


async def _until(work, preempt: asyncio.Event) -> str | None:
    """Run the coroutine `work` until it returns or `preempt` is set; None when the preempt came first (the work is
    cancelled: its stream closed, which aborts the request on the server). Cancelling the caller cancels both."""
    task, called = asyncio.ensure_future(work), asyncio.ensure_future(preempt.wait())
    try:
        await asyncio.wait({task, called}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        for pending in (task, called):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, called, return_exceptions=True)


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
    if isinstance(exc, (ConnectionError, TimeoutError)):  # a weight transport's peer that died or hung
        return True
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
    reason = finish_reason(choice.get("finish_reason"))
    routes = routed_experts(choice.get("routed_experts"), len(prompt_ids) + len(token_ids) - 1)
    return SamplingResult(list(token_ids), [float(x) for x in logprobs], list(versions), reason, prompt_ids, routes)


def finish_reason(reason) -> str:
    """`choices[0].finish_reason` when it is one a `SamplingResult` holds; ValueError naming the field otherwise."""
    if reason not in get_args(FinishReason):
        raise ValueError(f"choices[0].finish_reason: unexpected value {reason!r}")
    return reason


def routed_experts(encoded: str | None, positions: int):
    """vLLM's `routed_experts` (`--enable-return-routed-experts`: base64 of a `.npy` array `(positions, layers, top_k)`,
    every input position's experts, the last sampled token never an input) as the int16 tensor `SamplingResult.routes`
    holds; None when absent. ValueError naming the field when it does not decode to that shape."""
    if encoded is None:
        return None
    # here, not at the top: the client and the protocol import no tensor library until routes come
    import numpy
    import torch

    try:
        array = numpy.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except (ValueError, OSError, TypeError) as exc:
        raise ValueError(f"choices[0].routed_experts: not a base64 .npy array ({exc})") from exc
    if array.ndim != 3 or array.shape[0] != positions or array.dtype.kind not in "iu":
        raise ValueError(
            f"choices[0].routed_experts: expected integers shaped ({positions}, layers, top_k), got {array.dtype} "
            f"{tuple(array.shape)}"
        )
    return torch.from_numpy(array.astype(numpy.int16))
