"""Where rollouts run: one small interface the trainer uses for the in-process engine and for external servers.

- `EmbeddedRollouts`: the embedded engine in this process; publishing loads the tensors between decode steps.
- `HttpRollouts`: `sao engine serve` or vLLM servers over HTTP (`EnginePool`). Publishing writes the weights
  as an HF model directory `publish_dir/v{version:08d}` (atomically), posts its path to every server, and
  keeps the last two directories (a server that is reviving may still be loading the previous one). The
  servers must read `publish_dir` at the same path (same machine or a shared filesystem).

Resuming after a crash: the crashed trainer may have published versions past its last checkpoint, and its
servers still serve one. A `sao` server reports the path it loaded (`/health`); one ahead of the resumed
version whose path is one of `publish_dir`'s version directories was moved there by this run (the publish dir
belongs to one run home), so it is rewound: sent the resumed weights with the `rewind` flag before any
traffic. One ahead with any other path (or none: its starting weights) may serve another run, and is refused.
The crashed run's directories above the resumed version are removed: the resumed run writes its own.

Both run on the caller's asyncio loop: construct them, then call `publish`, `metrics` and `close` from the
same loop the agent runner generates on.
"""

from __future__ import annotations

import asyncio
import copy
import re
import shutil
from pathlib import Path
from typing import Literal, Protocol

import httpx
import torch
from torch import nn

from components.faults import fault_point
from components.models import save_model_dir
from components.rollout.client import EngineClient, health_json
from components.rollout.embedded import EmbeddedEngine
from components.rollout.pool import EnginePool
from components.rollout.weights import validate_weights
from components.storage import MARKER, atomic_dir

ServerKind = Literal["sao", "vllm"]
_CLIENT_BACKEND: dict[str, str] = {"sao": "embedded", "vllm": "vllm"}
_PUBLISHED = re.compile(r"v\d{8}")
KEEP_PUBLISHED = 2


class Rollouts(Protocol):
    """What the trainer needs from wherever rollouts run."""

    engine: object
    """What the agent runner calls: `async generate(SamplingRequest) -> SamplingResult`."""
    version: int
    """The newest published policy version."""

    async def start(self) -> None:
        """Every engine that answers serves the trainer's starting weights (`version`) when this returns."""

    async def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Every live engine serves `version` when this returns."""

    def metrics(self) -> dict[str, float]:
        """At least `rollout/engine_errors`: requests that failed on a dead or crashing engine (cumulative)."""

    async def close(self) -> None: ...


class EmbeddedRollouts:
    """The embedded engine in this process, on a private copy of `module` (it loads weights in place)."""

    def __init__(
        self, module: nn.Module, tokenizer, max_batch: int, version: int = 0, threads: int | None = None
    ) -> None:
        self.engine = EmbeddedEngine(
            copy.deepcopy(module), tokenizer, max_batch=max_batch, version=version, threads=threads
        ).start()
        self.version = version

    async def start(self) -> None:
        """Nothing to send: the engine runs on a copy of the trainer's own module."""

    async def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        fault_point("weights.publish")
        await asyncio.wrap_future(self.engine.load_weights(weights, version))
        self.version = version

    def metrics(self) -> dict[str, float]:
        return {"rollout/engine_errors": 0.0}

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)  # joins the engine thread


class HttpRollouts:
    """Rollouts on external servers: `engine` is an `EnginePool` over `urls` (see the module docstring).

    At construction every server is asked `/health` (blocking, `probe_timeout_s` each); with no answer from
    any, it refuses to start. A server that does not answer yet is probed again on the first requests. The
    weights of `module_template` are published first as `version` (0 on a fresh start), and no server gets
    traffic before it serves them: whatever a server was started from, the first batches come from the weights
    the trainer holds. A `sao` server that already serves a version above `version`
    is rewound to it when it loaded that version from `publish_dir`, and refused otherwise (see the module
    docstring). `module_template` is an HF `PreTrainedModel` (saved with `save_pretrained`); a CPU copy of it
    is kept, so the caller may go on training the original.
    """

    def __init__(
        self,
        urls: list[str],
        module_template: nn.Module,
        tokenizer,
        publish_dir: str | Path,
        server: ServerKind = "sao",
        timeout_s: float = 300.0,
        retries: int = 1,
        version: int = 0,
        revive_after_s: float = 2.0,
        probe_timeout_s: float = 5.0,
        max_wait_s: float = 30.0,
    ) -> None:
        if not urls:
            raise ValueError("urls: at least one engine server URL is needed")
        if server not in _CLIENT_BACKEND:
            raise ValueError(f"server: expected one of {sorted(_CLIENT_BACKEND)}, got {server!r}")
        health = {url: _probe(url, probe_timeout_s) for url in urls}
        if all(info is None for info in health.values()):
            raise ConnectionError(f"urls: no engine server answers /health at {', '.join(urls)}")
        # Resolved once: the paths posted to the servers, and those they report back, are compared to it.
        self.publish_dir = Path(publish_dir).resolve()
        ahead = {
            url: info
            for url, info in health.items()
            if info is not None and info.get("version") is not None and info["version"] > version
        }
        for url, info in ahead.items():
            if not self._published_here(info.get("path")):
                raise ValueError(
                    f"urls: {url} serves version {info['version']}, above the trainer's version {version}, from "
                    f"{info.get('path') or 'its starting weights'}, not from this run's publish_dir "
                    f"{self.publish_dir}: it may serve another run; restart it from the trainer's starting weights"
                )
        self.tokenizer = tokenizer
        self.version = version
        # A CPU copy: publishing loads each version into it and saves it as an HF directory.
        self._template = copy.deepcopy(module_template).to("cpu").eval()
        self._published: list[Path] = []
        self._lock = asyncio.Lock()
        clients = [
            EngineClient(
                url, timeout_s=timeout_s, retries=retries, backend=_CLIENT_BACKEND[server], default_version=version
            )
            for url in urls
        ]
        self.engine = EnginePool(
            clients, revive_after_s=revive_after_s, probe_timeout_s=probe_timeout_s, max_wait_s=max_wait_s
        )
        # The trainer's own weights are published as `version` before any traffic, on a fresh start too: a server
        # started from a directory the trainer does not hold (another checkpoint, another rope or dtype) would
        # otherwise sample the first batches, and their DIS ratios would compare two different models.
        self._remove_above(version)  # a crashed predecessor's versions: never to be served again
        weights = {k: v.detach() for k, v in module_template.state_dict().items()}
        self.engine.latest = (str(self._write(weights, version)), version)
        for pool_server, (url, info) in zip(self.engine.servers, health.items()):
            if info is None:
                self.engine.hold(pool_server, "no answer on /health at start")
            elif url in ahead:
                pool_server.rewind = True
                self.engine.hold(pool_server, f"rewinding from v{info['version']} to weights v{version}")
            elif (info.get("path"), info.get("version")) != self.engine.latest:
                self.engine.hold(pool_server, f"waiting for weights v{version}")
            else:
                pool_server.version, pool_server.path = version, info.get("path")

    async def start(self) -> None:
        """Send the starting weights to every server held for them (a server that does not answer gets them when a
        probe finds it); the first request would do the same, this does it before the first rollout."""
        await self.engine.sync()

    async def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        if version <= self.version:
            raise ValueError(f"version: {version} must be greater than the published version {self.version}")
        async with self._lock:
            path = await asyncio.to_thread(self._write, weights, version)
            fault_point("weights.publish")  # written for the servers, not yet loaded by them
            await self.engine.publish(str(path), version)
            self.version = version
            await asyncio.to_thread(self._prune)

    def metrics(self) -> dict[str, float]:
        return {"rollout/engine_errors": float(self.engine.errors), "rollout/engines_live": float(self.engine.live())}

    async def close(self) -> None:
        await self.engine.aclose()

    def _write(self, weights: dict[str, torch.Tensor], version: int) -> Path:
        """Save `weights` as the HF model directory `publish_dir/v{version:08d}` (complete or absent)."""
        validate_weights(self._template, weights)
        with torch.no_grad():
            self._template.load_state_dict(weights, strict=False)
        path = self.publish_dir / f"v{version:08d}"
        with atomic_dir(path) as tmp:
            save_model_dir(self._template, self.tokenizer, tmp)
        self._published.append(path)
        return path

    def _published_here(self, path: str | None) -> bool:
        """Whether `path` (as a server reports it) is one of `publish_dir`'s version directories."""
        if path is None:
            return False
        resolved = Path(path).resolve()
        return resolved.parent == self.publish_dir and _PUBLISHED.fullmatch(resolved.name) is not None

    def _remove_above(self, version: int) -> None:
        """Remove the published directories of versions above `version`."""
        if self.publish_dir.is_dir():
            for path in self.publish_dir.iterdir():
                if _PUBLISHED.fullmatch(path.name) and int(path.name[1:]) > version:
                    (path / MARKER).unlink(missing_ok=True)  # as `atomic_fill` does: never half-deleted yet complete
                    shutil.rmtree(path)

    def _prune(self) -> None:
        """Remove every published directory but the last `KEEP_PUBLISHED` this object wrote."""
        keep = set(self._published[-KEEP_PUBLISHED:])
        self._published = self._published[-KEEP_PUBLISHED:]
        for path in self.publish_dir.iterdir():
            if _PUBLISHED.fullmatch(path.name) and path not in keep:
                shutil.rmtree(path, ignore_errors=True)


def _probe(url: str, timeout_s: float) -> dict | None:
    """The server's `/health` JSON (`{}` for an empty body), or None when it does not answer 200."""
    try:
        return health_json(httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s))
    except httpx.HTTPError:
        return None
