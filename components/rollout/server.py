"""HTTP server for the embedded engine: the subset of vLLM's OpenAI-compatible API a trainer needs.

- `POST /v1/completions`. The prompt is a list of token ids (or a string, tokenised by the server). The
  response has vLLM's shape: `choices[0].token_ids`, `choices[0].logprobs.token_logprobs` and
  `choices[0].finish_reason`, plus a per-token `choices[0].versions` list.
- `POST /v1/chat/completions`: OpenAI's chat API (messages, tools, log-probs, streaming) rendered and parsed by
  the model's chat format, with the prompt's and the completion's token ids and the versions
  (components/rollout/chat_api.py).
- `GET /v1/models`.
- `GET /health`: `{"status", "version", "path", "in_flight"}`; `path` is that of the last weights loaded
  through `/v1/weights` (null for the starting weights), so a resumed trainer can tell its own crashed
  predecessor's versions from another run's.
- `GET /metrics`: Prometheus text (`sao_engine_*`, label `model`; components/tracking/prometheus.py, docs/metrics.md).
- `POST /v1/weights` with `{"path": <HF model directory or safetensors file>, "version": <int>}`. The version
  must be above the one served, unless the body also has `"rewind": true` (a resumed trainer taking back
  versions its crashed predecessor published).
- `POST /v1/weights/group` and `POST /v1/weights/receive`: the collective transport (a process group with
  the trainer, then checkpoint-named tensors in buckets over it; components/rollout/transfer.py).

Who may call what is `Access` (components/rollout/access.py): the weight routes take a bearer token, the
OpenAI routes an API key, when configured (401 otherwise), and a path outside the publish root is refused
with 403; a refused request changes nothing.

Bad requests get HTTP 400 with an OpenAI-style error whose `param` names the field (413 for a body over
`MAX_BODY_BYTES`); no input gives a 500. Sampling options that would make the logged log-probs differ from the
sampling distribution (top_p < 1, top_k, n > 1), and unknown fields (a penalty or `echo` would be silently
ignored otherwise), are refused rather than ignored.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError

from components.chat import ChatFormat, FormatError, chat_format
from components.models import load_policy, load_tokenizer
from components.rollout.access import OPEN, Access, bearer_matches
from components.rollout.chat_api import add_chat_route
from components.rollout.embedded import EmbeddedEngine
from components.rollout.engine_process import EngineProcess
from components.rollout.protocol import SamplingResult
from components.rollout.sampling import BadRequest, CompletionRequest, sample, sampling_request
from components.rollout.transfer import GroupMismatch, GroupRequest, Receiver, ReceiveRequest
from components.tracking.prometheus import EngineMetrics

MAX_BODY_BYTES = 16 * 2**20
"""Largest request body accepted: a prompt of 1M token ids as JSON is ~7 MiB."""


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)
    version: int = Field(ge=0)
    rewind: bool = False
    """Accept a version not above the one served: only a resumed trainer sends it (components/rollout/backends.py)."""
    drain: bool = False
    """Load once the sequences in flight have finished (`rollout.update_mode = "drain"`), not between two steps."""


def _error(status: int, message: str, param: str | None, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


def _unauthorized(access: Access, request: Request) -> JSONResponse | None:
    """The 401 for a request without the credential its route needs here (None: let it through). The route is
    the one the router matches (the path below any root path), so no spelling of a path slips past the check."""
    route = request.scope["path"].removeprefix(request.scope.get("root_path", ""))
    secret = access.required(route)
    header = request.headers.get("authorization")
    if secret is None or bearer_matches(header, secret):
        return None
    sent = "none was sent" if header is None else "the one sent does not match"
    needed = f"{route} needs the server's {access.credential_name(route)} as `Authorization: Bearer <token>`"
    response = _error(401, f"authorization: {needed}; {sent}", "authorization", "AuthenticationError")
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def create_app(
    engine: EmbeddedEngine, model_name: str, access: Access = OPEN, chat: ChatFormat | None = None
) -> FastAPI:
    """A FastAPI app serving `engine` to the callers `access` lets in; the caller starts and stops the engine.
    The chat route speaks `chat`, by default the format the engine's tokenizer defines (`chat_format`)."""
    app = FastAPI(title="sao embedded engine")
    served = EngineMetrics(engine, model_name)  # its own registry: several apps can live in one process
    receiver = Receiver(engine)
    _add_guards(app, access)
    _add_error_handlers(app)
    _add_status_routes(app, engine, model_name, served, receiver)
    _add_completion_route(app, engine, model_name, served)
    add_chat_route(app, engine, model_name, served, chat or _detected_format(engine))
    _add_weight_routes(app, engine, access, receiver)
    return app


def _detected_format(engine: EmbeddedEngine) -> ChatFormat | FormatError:
    """The chat format of the engine's tokenizer, or why there is none (the chat route then says so)."""
    if engine.tokenizer is None:
        return FormatError("the engine has no tokenizer")
    try:
        return chat_format(engine.tokenizer)
    except FormatError as exc:
        return exc


def _add_guards(app: FastAPI, access: Access) -> None:
    """The checks every request passes before its route: its credentials and the size of its body.

    Starlette runs the middleware added last first, so the body limit is checked before the credentials."""

    @app.middleware("http")
    async def _credentials(request: Request, call_next):
        refused = _unauthorized(access, request)
        return refused if refused is not None else await call_next(request)

    @app.middleware("http")
    async def _body_limit(request: Request, call_next):
        length = request.headers.get("content-length", "0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return _error(413, f"body: {length} bytes is more than the {MAX_BODY_BYTES} accepted", "body")
        return await call_next(request)


def _add_error_handlers(app: FastAPI) -> None:
    """Bad requests, whether FastAPI's validation or a route's `BadRequest`, answer 400 naming the field."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = _invalid_param(first)
        return _error(400, f"{param}: {first['msg']}", param)

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc), exc.param)


def _invalid_param(error: dict) -> str:
    """The field a validation error is about: `body` for a body that is not JSON, else the field and its list
    indices."""
    # loc is ("body", field, ...) for a field (an unknown one too) and ("body", position) for a JSON decode
    # error; after the field, a union adds its member's name (`list[int]`, `str`): keep the list indices only.
    loc = error["loc"][1:]
    if error["type"] == "json_invalid" or not loc:
        return "body"
    return ".".join([str(loc[0]), *(str(p) for p in loc[1:] if isinstance(p, int))])


def _add_status_routes(
    app: FastAPI, engine: EmbeddedEngine, model_name: str, served: EngineMetrics, receiver: Receiver
) -> None:
    """The read-only routes: `/health`, `/metrics` and `/v1/models`."""

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "version": engine.version,
            "path": engine.weights_path,
            "in_flight": engine.in_flight,
            "transfer_group": receiver.group_id,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = served.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "owned_by": "sao", "max_model_len": engine.max_model_len}],
        }


def _add_completion_route(app: FastAPI, engine: EmbeddedEngine, model_name: str, served: EngineMetrics) -> None:
    """`POST /v1/completions`: one sampled completion per request, in vLLM's response shape."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict:
        request = sampling_request(body, model_name, engine.tokenizer)
        result = await sample(engine, served, request)  # the engine checks the context length and the vocabulary
        return _completion(body, result, model_name, engine.tokenizer)


def _completion(body: CompletionRequest, result: SamplingResult, model_name: str, tokenizer) -> dict:
    """The OpenAI completion response for `result`, with vLLM's extras: the per-token versions, and the token ids
    when the body asks for them (`return_token_ids`)."""
    text = tokenizer.decode(result.token_ids) if tokenizer is not None else ""
    tokens = [f"token_id:{t}" for t in result.token_ids]
    choice = {
        "index": 0,
        "text": text,
        "finish_reason": result.finish_reason,
        "stop_reason": None,
        "versions": result.versions,
        "logprobs": None
        if body.logprobs is None
        else {
            "tokens": tokens,
            "token_logprobs": result.logprobs,
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, result.logprobs)],
            "text_offset": [],
        },
    }
    if body.return_token_ids:
        choice["token_ids"] = result.token_ids
        choice["prompt_token_ids"] = result.prompt_ids
    n_prompt, n_out = len(result.prompt_ids), len(result.token_ids)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [choice],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
    }


def _add_weight_routes(app: FastAPI, engine: EmbeddedEngine, access: Access, receiver: Receiver) -> None:
    """The routes that change the served weights: from a path (`/v1/weights`) or over the collective transport
    (`/v1/weights/group`, then `/v1/weights/receive`)."""

    @app.post("/v1/weights")
    async def weights(body: WeightsRequest) -> dict:
        if not access.allows_path(body.path):  # checked before anything is read: no oracle of what exists outside
            message = f"path: {body.path} is outside the publish root {access.publish_root}"
            return _error(403, message, "path", "PermissionDeniedError")
        start = time.perf_counter()
        try:
            await engine.publish_weights(body.path, body.version, body.rewind, body.drain)
        except (OSError, ValueError, SafetensorError) as exc:  # no file, not weights, wrong shapes, old version
            param = "version" if str(exc).startswith("version") else "path"
            message = str(exc) if str(exc).startswith(param) else f"{param}: {body.path}: {exc}"
            raise BadRequest(param, message) from exc
        return {"version": engine.version, "seconds": time.perf_counter() - start}

    @app.post("/v1/weights/group")
    async def group(body: GroupRequest) -> dict:
        try:
            await receiver.join(body)
        except ValueError as exc:  # a bad backend
            raise BadRequest("group", f"group: {exc}") from exc
        except (
            RuntimeError
        ) as exc:  # no store at that address, a sender that never formed its side: the trainer retries
            return _error(503, f"group: {exc}", "group", "ServiceUnavailableError")
        return {"transfer_group": receiver.group_id}

    @app.post("/v1/weights/receive")
    async def receive(body: ReceiveRequest) -> dict:
        start = time.perf_counter()
        try:
            received = await receiver.receive(body)
        except GroupMismatch as exc:  # not the group held here: the trainer forms a new one and sends again
            return _error(409, str(exc), "group", "Conflict")
        except ValueError as exc:  # a manifest that does not fit the model, an old version
            param = str(exc).split(":", 1)[0]
            raise BadRequest(param if param in ReceiveRequest.model_fields else "tensors", str(exc)) from exc
        return {"version": engine.version, "seconds": time.perf_counter() - start, "bytes": received}


def serve(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 64,
    threads: int | None = None,
    access: Access = OPEN,
    dtype: torch.dtype = torch.float32,
) -> None:
    """`sao engine serve`: load an HF model directory in `dtype` and serve it until interrupted, to the callers
    `access` lets in (the CLI builds it from the environment and `--publish-root`, and refuses an unsafe bind with
    `check_bind`). Weights posted later are cast to `dtype` as they load."""
    if threads is not None:
        # Busy-waiting OpenMP threads collapse throughput when clients share the cores (measured: 2 threads
        # with 32 local clients gave 0.56x of 1 thread).
        torch.set_num_threads(threads)

    engine = EmbeddedEngine(load_policy(model_path, dtype), load_tokenizer(model_path), max_batch=max_batch).start()
    try:
        uvicorn.run(create_app(engine, Path(model_path).name, access), host=host, port=port, log_level="warning")
    finally:
        engine.shutdown()


class ServerThread:
    """Run an app under uvicorn on a loopback port in a background thread (tests, benchmarks, the trainer).

    `with ServerThread(app) as url: ...` binds an ephemeral port first, so the URL is known before start.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


@contextlib.contextmanager
def serve_subprocess(model_dir: str | Path, threads: int | None = None, timeout_s: float = 120.0):
    """`sao engine serve` in a child process on a free loopback port; yields its URL once `/health` answers."""
    engine = EngineProcess(model_dir, threads=threads).start(timeout_s)
    try:
        yield engine.url
    finally:
        engine.stop()
