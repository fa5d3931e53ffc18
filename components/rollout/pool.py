"""Several engine servers behind one `generate`: load spreading, fail-over, and revival with the latest weights.

`EnginePool` is what the agent runner samples from when rollouts run on external servers (`sao engine serve`
or vLLM). Each request goes to the live server with the fewest requests in flight (ties in turn). Requests
are stateless (prompt ids in, tokens out), so when a server fails one (connection error, timeout, HTTP 5xx,
or an `abort` answer from a server shutting down) the server is taken out of traffic and the same request
is sent to another live server: the episode goes on and is never duplicated. An answer comes whole from the
one server that finished the request, with that server's per-token versions; whatever a failed server had
generated is discarded. A request the server refuses (HTTP 4xx) is the caller's mistake and is raised, not
retried.

A server that is down is probed on `/health` again after a back-off (doubling per consecutive failure), and
before it gets traffic again it is sent the latest published weights: it may have restarted with old ones.
A `sao` server that restarts between two requests fails none (the client reconnects silently), but its next
answer carries versions below the one it was sent: that answer is discarded and the server revived the same way.
When every server is down, requests wait for a probe to revive one, up to `max_wait_s` into the outage, and
then all fail with `EnginesDown`: the caller's run stops with the reason instead of hanging.
Everything runs on the caller's asyncio loop; no threads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from components.rollout.client import EngineClient, EngineError, server_failed
from components.rollout.protocol import SamplingRequest, SamplingResult

EXCLUDED = float("inf")
"""`Server.retry_at` of a server out of the pool for good (never probed again)."""
REFUSALS = (401, 403)
"""HTTP statuses of a server that refuses the trainer's credentials or paths (components/rollout/access.py)."""


class EnginesDown(RuntimeError):
    """No server of the pool can take a request; the message names every server and why it is down."""


@dataclass
class Server:
    """One server of the pool and what the pool knows about it."""

    client: EngineClient
    """The HTTP client for this server."""
    up: bool = True
    """Whether it gets traffic."""
    in_flight: int = 0
    """Requests sent and not yet answered."""
    served: int = 0
    """Requests it answered."""
    version: int | None = None
    """Weights version it serves, as last reported or published (None: unknown, e.g. vLLM before a publish)."""
    path: str | None = None
    """Where the weights it serves were loaded from, as last reported or published (None: its starting weights,
    or unknown). A server is in sync when (path, version) is the pool's `latest`."""
    rewind: bool = False
    """It serves a version this run's crashed predecessor published, above the resumed one: its next weights go
    with the rewind flag (which lets the version go down), once."""
    failures: int = 0
    """Consecutive failures (requests or probes); sets the back-off before the next probe."""
    retry_at: float = 0.0
    """`time.monotonic()` after which a down server is probed again."""
    last_error: str = ""
    """Why it is down."""
    epoch: int = 0
    """Incremented on each revival: a failure of a request sent before it does not take the server down again."""
    revival: asyncio.Task | None = field(default=None, repr=False)
    """The probe-and-sync task while one runs."""

    @property
    def url(self) -> str:
        return self.client.base_url


class EnginePool:
    """`generate` over several servers (see the module docstring); `publish` sends weights to every live one."""

    def __init__(
        self,
        clients: list[EngineClient],
        revive_after_s: float = 2.0,
        max_backoff_s: float = 60.0,
        probe_timeout_s: float = 5.0,
        max_wait_s: float = 30.0,
        load: Callable[[EngineClient, str, int, bool], Awaitable[None]] | None = None,
    ) -> None:
        """`load(client, path, version, rewind)` brings one server to the weights at `path` (a label for a
        transport that writes no file; components/rollout/transports.py); default: post the path."""
        if not clients:
            raise ValueError("clients: the pool needs at least one server")
        if revive_after_s <= 0 or max_backoff_s < revive_after_s:
            raise ValueError(
                f"revive_after_s: must be > 0 and <= max_backoff_s ({max_backoff_s}), got {revive_after_s}"
            )
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s: must be >= 0, got {max_wait_s}")
        self.servers = [Server(client) for client in clients]
        self.revive_after_s, self.max_backoff_s, self.probe_timeout_s = revive_after_s, max_backoff_s, probe_timeout_s
        self.max_wait_s = max_wait_s
        """How long requests wait for a server to come back once all are down, before `EnginesDown`: a short
        outage (a restart) costs time, not episodes, and a long one ends the caller's run, not hangs it."""
        self.down_since: float | None = None
        """`time.monotonic()` when a request first found no live server; None while one is live. The wait is
        counted from here for every request, so all of them give up together, `max_wait_s` into the outage."""
        self.latest: tuple[str, int] | None = None
        """(path, version) of the newest published weights: what a revived server is sent first."""
        self.errors = 0
        """Requests and weight posts that failed on a dead, hung or crashing server (cumulative)."""
        self._turn = 0  # where the round-robin among equally loaded servers resumes
        self.load = load or (lambda client, path, version, rewind: client.publish_weights(path, version, rewind))

    async def generate(self, request: SamplingRequest) -> SamplingResult:
        while True:
            server = await self._pick()
            epoch, loaded = server.epoch, server.version
            server.in_flight += 1
            try:
                result = await server.client.generate(request)
            except Exception as exc:
                if not server_failed(exc):
                    raise
                self._fail(server, epoch, f"{type(exc).__name__}: {exc}")
                continue
            finally:
                server.in_flight -= 1
            if result.finish_reason == "abort":  # the server is shutting down; its partial output is discarded
                self._fail(server, epoch, "aborted a request (shutting down)")
                continue
            if (
                server.client.backend == "embedded"
                and loaded is not None
                and min(result.versions, default=loaded) < loaded
            ):
                # Sent after the server had loaded `loaded`, answered by older weights: it restarted between two
                # requests (its connection reopened silently) and serves its starting weights. Discarded.
                self._fail(server, epoch, f"answered with v{min(result.versions)} after loading v{loaded}: restarted")
                continue
            server.served += 1
            server.failures = 0
            return result

    async def publish(self, path: str, version: int) -> None:
        """Load the weights at `path` as `version` on every live server; a down one gets them when it revives.

        A server that fails the post is taken down (and counted in `errors`); a refusal (HTTP 4xx: bad path
        or version) is raised.
        """
        self.latest = (path, version)
        await self.sync()
        live = [s for s in self.servers if s.up and (s.path, s.version) != self.latest]

        async def post(server: Server) -> None:
            epoch = server.epoch
            try:
                await self.load(server.client, path, version, False)
            except Exception as exc:
                if not server_failed(exc):
                    raise
                self._fail(server, epoch, f"weights v{version}: {type(exc).__name__}: {exc}")
                return
            server.version, server.path = version, path

        outcomes = await asyncio.gather(*(post(s) for s in live), return_exceptions=True)
        for server, outcome in zip(live, outcomes):
            if isinstance(outcome, BaseException):
                raise RuntimeError(f"publish v{version} to {server.url}: {outcome}") from outcome

    async def sync(self) -> None:
        """Bring every held server (`hold`: not failed, only waiting for weights) to `latest` now, rather than on
        its first request; one that does not answer goes down with the reason and is probed again later."""
        for server in self.servers:
            if not server.up and server.failures == 0 and server.revival is None:
                server.revival = asyncio.create_task(self._revive(server))
        held = [s.revival for s in self.servers if s.revival is not None and s.failures == 0]
        await asyncio.gather(*held, return_exceptions=True)

    def hold(self, server: Server, reason: str) -> None:
        """Take `server` out of traffic until a probe (due at once) finds it alive and it has the latest weights."""
        server.up, server.last_error, server.retry_at = False, reason, 0.0

    def exclude(self, server: Server, reason: str) -> None:
        """Take `server` out of the pool for the rest of the run (it serves other weights than it was sent)."""
        server.up, server.last_error, server.failures, server.retry_at = False, reason, server.failures + 1, EXCLUDED

    def live(self) -> int:
        return sum(s.up for s in self.servers)

    async def aclose(self) -> None:
        tasks = [s.revival for s in self.servers if s.revival is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.client.aclose() for s in self.servers))

    # ---- internals --------------------------------------------------------------------------------------

    async def _pick(self) -> Server:
        """The live server with the fewest requests in flight, ties in turn. When no server is live it waits for
        running revivals and for probes due before `max_wait_s` into the outage (`down_since`), and raises
        `EnginesDown` once none is left to wait for."""
        while True:
            self._start_due_revivals()
            live = [s for s in self.servers if s.up]
            if live:
                self.down_since = None
                fewest = min(s.in_flight for s in live)
                n = len(self.servers)
                for k in range(n):
                    server = self.servers[(self._turn + k) % n]
                    if server.up and server.in_flight == fewest:
                        self._turn = (self._turn + k + 1) % n
                        return server
            now = time.monotonic()
            if self.down_since is None:
                self.down_since = now
            deadline = self.down_since + self.max_wait_s
            running = [s.revival for s in self.servers if s.revival is not None]
            next_probe = min(s.retry_at for s in self.servers)
            if not running and next_probe <= deadline:
                await asyncio.sleep(max(next_probe - now, 0.0) + 0.01)
                continue
            if not running:
                raise EnginesDown(
                    f"every engine server is down: waited {now - self.down_since:.1f} s for one to come back "
                    f"(no probe is due within rollout.engine_wait_s = {self.max_wait_s:g} s): "
                    + "; ".join(
                        f"{s.url} ({s.last_error or 'down'}; next probe in {max(0.0, s.retry_at - now):.1f} s)"
                        for s in self.servers
                    )
                )
            done, _ = await asyncio.wait(running)
            for task in done:  # a bug in a revival (not a down server) must surface, not loop
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()

    def _fail(self, server: Server, epoch: int, reason: str) -> None:
        self.errors += 1
        if epoch != server.epoch:
            return  # the request was sent before the server's last revival: it says nothing about the server now
        if server.up:
            server.up = False
            server.failures += 1
        server.last_error = reason
        self._back_off(server)

    def _back_off(self, server: Server) -> None:
        """Next probe after `revive_after_s`, doubled per consecutive failure, at most `max_backoff_s`."""
        delay = min(self.revive_after_s * 2 ** max(0, server.failures - 1), self.max_backoff_s)
        server.retry_at = time.monotonic() + delay

    def _start_due_revivals(self) -> None:
        now = time.monotonic()
        for server in self.servers:
            if not server.up and server.revival is None and server.retry_at <= now:
                server.revival = asyncio.create_task(self._revive(server))

    async def _revive(self, server: Server) -> None:
        """Probe `/health`; if alive, send it the latest weights (again, if more were published meanwhile), then
        give it traffic. A failure leaves it down with the reason and a longer back-off."""
        revived = False
        try:
            info = await server.client.health_info(self.probe_timeout_s)
            if info is None:
                raise ConnectionError("no answer on /health")
            # The embedded server reports both; vLLM neither, so it is always sent the latest weights.
            server.version, server.path = info.get("version"), info.get("path")
            while self.latest is not None and (server.path, server.version) != self.latest:
                path, version = self.latest  # again if more weights were published while these loaded
                # Reloading the version it serves (the trainer's v0 over a server's own starting weights) is not
                # "above the one served": it goes with the rewind flag, as a resumed run's step back does.
                rewind = server.rewind or server.version == version
                await self.load(server.client, path, version, rewind)
                server.version, server.path, server.rewind = version, path, False
            server.up, server.last_error, revived = True, "", True
            server.epoch += 1
        except EngineError as exc:
            if exc.status in REFUSALS:  # a credential or path it refuses: no back-off will change that
                self.exclude(server, f"revival: {exc} (check SAO_WEIGHTS_TOKEN, SAO_API_KEY and the publish root)")
            else:
                server.last_error = f"revival: {type(exc).__name__}: {exc}"
        except (ConnectionError, httpx.HTTPError, TimeoutError) as exc:
            server.last_error = f"revival: {type(exc).__name__}: {exc}"
        finally:
            server.revival = None
            if not revived and server.retry_at != EXCLUDED:
                server.failures += 1
                self._back_off(server)
