"""Where rollouts run: one small interface the trainer uses for the in-process engine and for external servers.

- `EmbeddedRollouts`: the embedded engine in this process; publishing loads the tensors between decode steps.
- `HttpRollouts`: `sao engine serve` or vLLM servers over HTTP (`EnginePool`). Publishing stages the weights
  in a host copy and brings every server to them through `rollout.weight_transfer` (transports.py): an HF
  directory `publish_dir/v{version:08d}` the servers read (`filesystem`), or buckets over a process group
  (`collective`, no file). A probe then checks that the servers really serve them (probe.py).

Resuming after a crash: the crashed trainer may have published versions past its last checkpoint, and its
servers still serve one. A `sao` server reports the path it loaded (`/health`); one ahead of the resumed
version whose path is one of `publish_dir`'s version directories was moved there by this run (the publish dir
belongs to one run home), so it is rewound: sent the resumed weights with the `rewind` flag before any
traffic. One ahead with any other path (or none: its starting weights) may serve another run, and is refused.
The crashed run's directories above the resumed version are removed: the resumed run writes its own.

What happens where: constructing either does no network I/O (`HttpRollouts` checks its config section and
builds its local parts, and holds every server); `start` does the rest before the first rollout: for
`HttpRollouts`, the `/health` probes, the refusals (no server answers, a server ahead that may serve another
run), the rewinds, the collective transport's rendezvous and the starting weights, staged and sent.

Both run on the caller's asyncio loop: construct them, then await `start` and call `publish`, `metrics` and
`close` from the same loop the agent runner generates on.
"""

from __future__ import annotations

import asyncio
import copy
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol, get_args

import httpx
import torch
from torch import nn

from components.config import RolloutConfig
from components.faults import fault_point
from components.rollout.access import OPEN, Access
from components.rollout.client import EngineClient, server_failed
from components.rollout.embedded import EmbeddedEngine
from components.rollout.pool import EXCLUDED, EnginePool
from components.rollout.probe import WeightsMismatch, compare, probe_requests, tolerance_for
from components.rollout.senders import Share
from components.rollout.transfer import route_address
from components.rollout.transports import (
    PUBLISHED,
    CollectiveTransport,
    FilesystemTransport,
    Transport,
    assign_weights,
)
from components.rollout.weights import validate_weights

TransferName = Literal["filesystem", "collective"]
TRANSFERS = get_args(TransferName)
_CLIENT_BACKEND: dict[str, str] = {"sao": "embedded", "vllm": "vllm"}


class Rollouts(Protocol):
    """What the trainer needs from wherever rollouts run."""

    engine: object
    """What the agent runner calls: `async generate(SamplingRequest) -> SamplingResult`."""
    version: int
    """The newest published policy version."""
    keeps_weights: bool
    """Whether `publish` keeps the `weights` it is given after it returns (the caller then passes a copy)."""

    async def start(self) -> None:
        """Every engine that answers serves the trainer's starting weights (`version`) when this returns."""

    async def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Every live engine serves `version` when this returns, or (an overlapped transfer) once `settle` has."""

    async def settle(self) -> None:
        """Wait for a transfer still running after `publish` returned; raises what it raised."""

    def metrics(self) -> dict[str, float]:
        """At least `rollout/engine_errors`: requests that failed on a dead or crashing engine (cumulative)."""

    def share(self, version: int) -> Share | None:
        """What the trainer's other ranks stage of `version`, gathering it, to send it themselves (the collective
        transfer with `rollout.transfer_senders = "all"`: components/rollout/senders.py); None: rank 0 sends all."""

    async def close(self) -> None: ...


class EmbeddedRollouts:
    """The embedded engine in this process, on a private copy of `module` (it loads weights in place)."""

    def __init__(
        self,
        module: nn.Module,
        tokenizer,
        max_batch: int,
        version: int = 0,
        threads: int | None = None,
        dtype: torch.dtype = torch.float32,
        record_routes: bool = False,
        drain: bool = False,
    ) -> None:
        self.drain = drain
        """Updates wait for the sequences in flight to finish (`rollout.update_mode = "drain"`) instead of continuing
        them on the new weights."""
        self.engine = EmbeddedEngine(
            copy.deepcopy(module).to(dtype),
            tokenizer,
            max_batch=max_batch,
            version=version,
            threads=threads,
            record_routes=record_routes,
        ).start()
        self.version = version

    keeps_weights = False  # loaded (copied into the engine's module) before `publish` returns

    async def start(self) -> None:
        """Nothing to send: the engine runs on a copy of the trainer's own module."""

    async def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        fault_point("weights.publish")
        await asyncio.wrap_future(self.engine.load_weights(weights, version, drain=self.drain))
        self.version = version

    async def settle(self) -> None:
        """Nothing runs on: `publish` returns once the engine has loaded the weights."""

    def metrics(self) -> dict[str, float]:
        return {"rollout/engine_errors": 0.0}

    def share(self, version: int) -> None:
        return None  # the engine loads the trainer's tensors in memory

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)  # joins the engine thread


class HttpRollouts:
    """Rollouts on external servers: `engine` is an `EnginePool` over `rollout.urls` (see the module docstring).

    The constructor checks the section and builds the local parts, and does no network I/O: a CPU copy of
    `module_template` with no storage of its own (every version is staged into it and sent from it by the
    `rollout.weight_transfer` transport, components/rollout/transports.py), the filesystem transport, and the pool,
    every server of which is held until `start`: a request before it fails at once, naming the reason.

    `start` asks every server `/health` (`probe_timeout_s` each); with no answer from any, it refuses to start. A
    `sao` server that already serves a version above `version` is rewound to it when it loaded that version from
    `publish_dir`, and refused otherwise (see the module docstring). The collective transport is opened then, its
    rendezvous on the route to a server that answered. The weights `module_template` holds at `start` are staged
    as `version` (0 on a fresh start), and every server is brought to them before any traffic: whatever a server
    was started from, the first batches come from the weights the trainer holds (a server that does not answer yet
    gets them when a probe finds it). `module_template` is an HF `PreTrainedModel` (saved with `save_pretrained`);
    the caller may go on training it once `start` has returned. Every `rollout.probe_every` versions (0: never)
    each server's log-probs of a fixed sample are checked against the host copy's (components/rollout/probe.py).

    `revive_after_s` (first back-off of a down server) and `probe_timeout_s` (one `/health` probe) are not config
    fields: tests set them short.
    """

    def __init__(
        self,
        rc: RolloutConfig,
        module_template: nn.Module,
        tokenizer,
        publish_dir: str | Path,
        *,
        version: int = 0,
        access: Access = OPEN,
        log: Callable[[str], None] = print,
        revive_after_s: float = 2.0,
        probe_timeout_s: float = 5.0,
        record_routes: bool = False,
        senders: int = 1,
    ) -> None:
        if not rc.urls:
            raise ValueError("rollout.urls: at least one engine server URL is needed")
        if rc.server not in _CLIENT_BACKEND:
            raise ValueError(f"rollout.server: expected one of {sorted(_CLIENT_BACKEND)}, got {rc.server!r}")
        if rc.weight_transfer not in TRANSFERS:
            raise ValueError(f"rollout.weight_transfer: expected one of {list(TRANSFERS)}, got {rc.weight_transfer!r}")
        self.rc, self.tokenizer, self.version, self.log = rc, tokenizer, version, log
        self.record_routes = record_routes
        """`algo.routing_replay = "r3"`: every server must return the experts it routed; `start` checks each."""
        self.senders = senders
        """Trainer ranks that send each version over the collective transfer (`rollout.transfer_senders`)."""
        # Resolved once: the paths posted to the servers, and those they report back, are compared to it.
        self.publish_dir = Path(publish_dir).resolve()
        self.probe_diff = self.probe_median = 0.0
        self.probe_failures = 0
        self.transfer_s = self.publish_bytes = 0.0
        self._pending: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._probe_timeout_s = probe_timeout_s
        self._starting = module_template.state_dict()
        """The weights `start` stages as `version` (read then: the caller does not train before it); empty after."""
        # A host model for each staged version's tensors (assigned, not copied): the filesystem path saves it, the
        # probe computes its reference log-probs on it.
        self._template = _meta_copy(module_template).eval()
        self._files = FilesystemTransport(self._template, tokenizer, self.publish_dir)
        self.transport: Transport = self._files
        """The filesystem transport; `start` replaces it with the collective one when `rollout.weight_transfer` asks."""
        self.keeps_weights = rc.weight_transfer == "filesystem"
        """`publish` keeps `weights` (the filesystem path writes them later): the caller passes a copy. The collective
        transport packs them into its buckets before `publish` returns."""
        self.engine = self._held_pool(access, revive_after_s, probe_timeout_s)

    def _held_pool(self, access: Access, revive_after_s: float, probe_timeout_s: float) -> EnginePool:
        """The pool over `rollout.urls`, every server held with no probe due until `start` brings it to the starting
        weights."""
        rc = self.rc
        clients = [
            EngineClient(
                url,
                timeout_s=rc.request_timeout_s,
                retries=rc.request_retries,
                backend=_CLIENT_BACKEND[rc.server],
                default_version=self.version,
                weights_token=access.weights_token,
                api_key=access.api_key,
                update_mode=rc.update_mode,
            )
            for url in rc.urls
        ]
        pool = EnginePool(
            clients,
            revive_after_s=revive_after_s,
            probe_timeout_s=probe_timeout_s,
            max_wait_s=rc.engine_wait_s,
            load=self._load,
        )
        for server in pool.servers:
            pool.hold(server, "not started: `await rollouts.start()` comes before the first request")
            server.retry_at = math.inf  # `start` probes it, not a request
        return pool

    async def start(self) -> None:
        """Probe every server, refuse one that may serve another run, stage the starting weights as `version` and
        bring every server that answers to them (one that does not gets them when a probe finds it); then, with
        `rollout.probe_every`, check that they serve them. See the class docstring."""
        if not self._starting:
            raise RuntimeError("start: called twice (the starting weights are staged once)")
        health = await self._health()
        self._refuse_foreign(health)
        if self.record_routes:
            await self._require_routes(health)
        if self.rc.weight_transfer == "collective":
            self.transport = self._collective(health)
        # The trainer's own weights are published as `version` before any traffic, on a fresh start too: a server
        # started from a directory the trainer does not hold (another checkpoint, another rope or dtype) would
        # otherwise sample the first batches, and their DIS ratios would compare two different models.
        self._files.remove_above(self.version)  # a crashed predecessor's versions: never to be served again
        self.engine.latest = (await asyncio.to_thread(self._stage_starting_weights), self.version)
        self._hold_for_weights(health)
        await self.engine.sync()
        if self.rc.probe_every:
            await self.check(self.version)

    async def _health(self) -> list[dict | None]:
        """Each server's `/health` JSON, in the pool's order (None: no answer); refuses to start when none answers."""
        probes = (server.client.health_info(self._probe_timeout_s) for server in self.engine.servers)
        health = await asyncio.gather(*probes)
        if all(info is None for info in health):
            raise ConnectionError(f"rollout.urls: no engine server answers /health at {', '.join(self.rc.urls)}")
        return health

    async def _require_routes(self, health: list[dict | None]) -> None:
        """Refuse to start when a server that answers returns no routed experts for a short request (routing replay
        would silently replay nothing)."""
        request = probe_requests(self._template.config.vocab_size)[0]
        for server, info in zip(self.engine.servers, health):
            if info is not None and (await server.client.generate(request)).routes is None:
                raise ValueError(
                    f'algo.routing_replay: "r3" needs every server to return the experts it routed, and {server.url} '
                    "returned none: start vLLM with --enable-return-routed-experts (vLLM 0.32 also needs "
                    "VLLM_USE_V2_MODEL_RUNNER=1, whose model runner needs Triton: a GPU)"
                )

    def _refuse_foreign(self, health: list[dict | None]) -> None:
        """Refuse a server ahead of the trainer that did not load that version from `publish_dir` (module docstring)."""
        for server, info in zip(self.engine.servers, health):
            if info is not None and self._ahead(info) and not self._published_here(info.get("path")):
                raise ValueError(
                    f"rollout.urls: {server.url} serves version {info['version']}, above the trainer's version "
                    f"{self.version}, from {info.get('path') or 'its starting weights'}, not from this run's "
                    f"publish_dir {self.publish_dir}: it may serve another run; restart it from the trainer's "
                    "starting weights"
                )

    def _collective(self, health: list[dict | None]) -> CollectiveTransport:
        """The collective transport; its rendezvous is at `rollout.transfer_address`, or (empty) at this host's address
        on the route to the first server that answered."""
        rc = self.rc
        answering = next(server.url for server, info in zip(self.engine.servers, health) if info is not None)
        address = rc.transfer_address or route_address(httpx.URL(answering).host)
        # the fallback writes a version a reviving server asks for while the host copy may hold the next one
        fallback = FilesystemTransport(_meta_copy(self._template), self.tokenizer, self.publish_dir)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        return CollectiveTransport(
            self.publish_dir,
            rc.transfer_bucket_mb * 2**20,
            address,
            rc.transfer_timeout_s,
            fallback if rc.transfer_fallback else None,
            self.log,
            backend,
            self.senders,
        )

    def _stage_starting_weights(self) -> str:
        """Stage the weights `module_template` held as `version` (a host copy first where the transport keeps them);
        returns the label the servers will report."""
        weights, self._starting = self._starting, {}  # the trainer's tensors: not held past the start
        return self._stage(weights if self.transport.copies else _host_copy(weights), self.version)

    def _hold_for_weights(self, health: list[dict | None]) -> None:
        """Give traffic to the servers that serve the starting weights already; hold the others for them (`sync`
        sends them), a server ahead of the trainer marked for the rewind."""
        for server, info in zip(self.engine.servers, health):
            if info is None:
                self.engine.hold(server, "no answer on /health at start")
            elif self._ahead(info):
                server.rewind = True
                self.engine.hold(server, f"rewinding from v{info['version']} to weights v{self.version}")
            elif (info.get("path"), info.get("version")) != self.engine.latest:
                self.engine.hold(server, f"waiting for weights v{self.version}")
            else:
                server.up, server.last_error, server.retry_at = True, "", 0.0
                server.version, server.path = self.version, info.get("path")

    async def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Stage `weights` as `version` and bring every live server to it. With `rollout.publish_overlap` this returns
        once they are staged (a host copy taken), and the transfer runs on while the caller trains the next version;
        the next `publish`, `settle` or `close` waits for it and raises what it raised."""
        if version <= self.version:
            raise ValueError(f"version: {version} must be greater than the published version {self.version}")
        async with self._lock:
            await self.settle()  # one version in transfer at a time: the staged copies are kept per version
            began = time.perf_counter()
            validate_weights(self._template, weights)
            label = None
            if self.transport.copies:  # staged now, from the trainer's tensors: they may move once this returns
                label = await asyncio.to_thread(self._stage, weights, version)
            self.version = version
            self._pending = asyncio.create_task(self._send(weights, version, began, label))
            if not self.rc.publish_overlap:
                await self.settle()

    def share(self, version: int) -> Share | None:
        return self.transport.share(version)

    async def settle(self) -> None:
        """Wait for the version in transfer (if any) to reach every live server; raises what the transfer raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            await pending

    async def _send(self, weights: dict[str, torch.Tensor], version: int, began: float, label: str | None) -> None:
        moved = self.transport.bytes
        if label is None:
            label = await asyncio.to_thread(self._stage, weights, version)
        fault_point("weights.publish")  # staged for the servers, not yet loaded by them
        await self.engine.publish(label, version)
        self.transfer_s, self.publish_bytes = time.perf_counter() - began, float(self.transport.bytes - moved)
        if self.rc.probe_every and version % self.rc.probe_every == 0:
            await self.check(version)

    async def check(self, version: int) -> None:
        """Probe every live server that serves `version` (probe.py); one that answers with other weights is taken
        out of the pool for good, and `WeightsMismatch` is raised once every server is out for good."""
        requests = probe_requests(self._template.config.vocab_size)
        tolerance = tolerance_for(self._template, self.rc.probe_tolerance)
        self.probe_diff = self.probe_median = 0.0  # this round's largest differences
        for server in [s for s in self.engine.servers if s.up and s.version == version]:
            try:
                results = await asyncio.gather(*(server.client.generate(r) for r in requests))
            except Exception as exc:
                if not server_failed(exc):
                    raise
                continue  # a dead server: the pool finds it on its next request and revives it with the weights
            found = await asyncio.to_thread(compare, server.url, self._template, results, version)
            self.probe_diff = max(self.probe_diff, found.max_abs_diff)
            self.probe_median = max(self.probe_median, found.median_abs_diff)
            if not found.ok(tolerance):
                self.probe_failures += 1
                tagged = sorted({v for result in results for v in result.versions})
                reason = (
                    f"weights probe after v{version}: its log-probs differ from the trainer's by "
                    f"{found.median_abs_diff:.3g} (median; rollout.probe_tolerance = {tolerance:g})"
                    + ("" if found.versions_ok else f", and its tokens are tagged {tagged}")
                )
                self.log(f"rollout: {server.url} taken out of the pool: {reason}")
                self.engine.exclude(server, reason)
        if all(s.retry_at == EXCLUDED for s in self.engine.servers):  # down for other reasons: they may come back
            raise WeightsMismatch(
                "every engine server failed the weights probe: "
                + "; ".join(f"{s.url} ({s.last_error})" for s in self.engine.servers)
            )

    def metrics(self) -> dict[str, float]:
        row = {
            "rollout/engine_errors": float(self.engine.errors),
            "rollout/engines_live": float(self.engine.live()),
            "rollout/transfer_s": self.transfer_s,
            "rollout/publish_bytes": self.publish_bytes,
            **self.transport.metrics(),
        }
        if self.rc.probe_every:
            row.update(
                {
                    "rollout/probe_median_abs_diff": self.probe_median,
                    "rollout/probe_max_abs_diff": self.probe_diff,
                    "rollout/probe_failures": float(self.probe_failures),
                }
            )
        return row

    async def close(self) -> None:
        try:
            await self.settle()
        finally:
            await self.engine.aclose()

    def _stage(self, weights: dict[str, torch.Tensor], version: int) -> str:
        """Load `weights` into the host copy (the probe's reference) and stage them as `version` with the transport;
        returns the label the servers report."""
        label, held = self.transport.stage(weights, version)
        assign_weights(self._template, held)
        return label

    async def _load(self, client: EngineClient, label: str, version: int, rewind: bool) -> None:
        """The pool's way to bring one server to a staged version: through `transport` as it is then (`start` may
        open the collective one)."""
        await self.transport.load(client, label, version, rewind)

    def _ahead(self, info: dict) -> bool:
        """Whether a server's `/health` JSON reports a version above the trainer's."""
        return info.get("version") is not None and info["version"] > self.version

    def _published_here(self, path: str | None) -> bool:
        """Whether `path` (as a server reports it) is one of `publish_dir`'s version directories."""
        if path is None:
            return False
        resolved = Path(path).resolve()
        return resolved.parent == self.publish_dir and PUBLISHED.fullmatch(resolved.name) is not None


def _meta_copy(module: nn.Module) -> nn.Module:
    """A host copy of `module` whose parameters have no storage (it is assigned those of each version it serves);
    its buffers are copied (rotary tables and the like are not in the weights sent). `module` lives on the host."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False) for p in module.parameters()}
    return copy.deepcopy(module, memo)


def _host_copy(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached host copies of `weights`, tied names still sharing one tensor."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in weights.items():
        key = tensor.data_ptr()
        if key not in copies or tensor.numel() == 0:
            copies[key] = tensor.detach().to("cpu", copy=True)
        out[name] = copies[key]
    return out


def open_rollouts(
    rc: RolloutConfig,
    module: nn.Module,
    tokenizer,
    home: Path,
    version: int,
    engine_threads: int,
    log: Callable[[str], None] = print,
    record_routes: bool = False,
    senders: int = 1,
) -> Rollouts:
    """Where episodes are generated (`rollout.backend`): the embedded engine on a copy of `module` in this
    process, or the `rollout.urls` servers, which load each version from `rollout.publish_dir`. `record_routes`:
    the engine records each token's MoE experts (`algo.routing_replay = "r3"`); `senders`: the trainer ranks that send
    each version over the collective transfer."""
    if record_routes and rc.backend != "embedded" and (rc.server != "vllm" or rc.update_mode != "drain"):
        raise ValueError(
            f'algo.routing_replay: "r3" needs the engine to return each token\'s experts: the embedded engine does, and '
            f'vLLM does in whole answers (`--enable-return-routed-experts`), so with rollout.backend = "http" it needs '
            f'rollout.server = "vllm" and rollout.update_mode = "drain" (a continued request streams, and vLLM 0.32 '
            f'returns no experts in a stream); got rollout.server = "{rc.server}", rollout.update_mode = '
            f'"{rc.update_mode}"'
        )
    backends: dict[str, Callable[[], Rollouts]] = {
        "embedded": lambda: EmbeddedRollouts(
            module,
            tokenizer,
            rc.max_batch,
            version,
            engine_threads,
            getattr(torch, rc.engine_dtype),
            record_routes,
            drain=rc.update_mode == "drain",
        ),
        "http": lambda: HttpRollouts(
            rc,
            module,
            tokenizer,
            Path(rc.publish_dir or home / "published"),
            version=version,
            access=Access.from_environment(),
            log=log,
            record_routes=record_routes,
            senders=senders,
        ),
    }
    return backends[rc.backend]()
