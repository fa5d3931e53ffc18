"""Pause, load, resume: the per-server gate that makes the version tags of a vLLM server's tokens true.

vLLM returns no per-token versions, and an in-place reload changes the weights under the requests it is running
(their later tokens come from the new weights, on a KV cache the old ones computed). So the client of a vLLM
server (`EngineClient` with backend="vllm") puts every request and every weight update through one
`VersionGate`:

- `request()` waits while an update is pending, counts the request in flight, and gives the version loaded
  when it was sent;
- `update(version, load)` stops new requests at once, waits until the requests in flight have all left the gate,
  runs the load, and only then lets the held requests go, on the new version. A load that has begun is never
  abandoned half-way by the gate: if its caller gives up, the gate still waits for the server's answer before it
  lets requests go.

How the requests in flight leave is the update mode (`rollout.update_mode`). Draining (`preempts=False`), they
are answered first, each having run on the weights it started on. Continuing (`preempts=True`), the update sets
the `preempt` event each request took when it entered: the client (components/rollout/client.py) stops reading
its stream, which aborts it on the server, keeps the tokens it has, and goes back through the gate to resume from
them on the new weights. Either way every token a client keeps was sampled while the version it is tagged with
was loaded, and no token is read across a load. The gate counts only this client's requests: it holds for the
trainer's client of a server, not for other callers of the same server. vLLM 0.32's own `POST /pause?mode=wait` + `POST /resume` do not give the same guarantee:
the pause lets running requests drain but keeps requests already queued (or preempted, which frees their KV)
for after the resume, so they run on the new weights (vllm/v1/core/sched/scheduler.py admits only KV-holding
requests under `PauseState.PAUSED_NEW`; vllm/v1/engine/core.py `pause_scheduler`), and a request still on its
way over HTTP arrives after the pause; the client would not know which of its requests those were.

An update that fails after it started may have left the server with weights of no known version: the gate then
refuses requests (`WeightsUnknown`, a ConnectionError, which the pool reads as a failed server and revives it
with the latest weights) until an update succeeds. An exception with `weights_unchanged = True` says the server
refused before touching its weights (a bad field, a group it does not hold): the gate then stays usable.
Everything runs on one asyncio loop; the bookkeeping never awaits inside `finally`, so a cancelled request or
update always leaves the counts right.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

T = TypeVar("T")


class WeightsUnknown(ConnectionError):
    """The server's weights are of no known version (an update failed part-way); no request goes to it."""


class VersionGate:
    """Requests and weight updates of one server, never overlapping (module docstring)."""

    def __init__(self, version: int = 0, preempts: bool = False) -> None:
        self.version = version
        """The version the server serves, as far as this client loaded it."""
        self.in_flight = 0
        """Requests sent through the gate and not yet answered."""
        self.unknown: str | None = None
        """Why the server's weights are of no known version (None: they are `version`)."""
        self._pending = 0  # updates waiting or running
        self._draining = 0  # updates waiting for the requests in flight
        self._open = asyncio.Event()  # set while no update is pending: requests may start
        self._open.set()
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._one = asyncio.Lock()  # one update at a time
        self.preempts = preempts
        """An update sets `preempt` to call the requests in flight back (the continue mode), instead of waiting."""
        self._preempt = asyncio.Event()  # replaced, unset, whenever the gate opens after updates

    @property
    def preempt(self) -> asyncio.Event:
        """Set when an update wants the requests in flight to leave (with `preempts`); take it on entering the gate."""
        return self._preempt

    @property
    def pending(self) -> int:
        """Updates waiting for the requests in flight, or loading."""
        return self._pending

    @property
    def draining(self) -> bool:
        """An update waits for the requests in flight to be answered (it has not begun to load)."""
        return self._draining > 0

    @asynccontextmanager
    async def request(self) -> AsyncIterator[int]:
        """Hold the caller while an update is pending, then yield the version the request is sent under; the request
        counts as in flight until the block exits (answered, failed or cancelled)."""
        while not self._open.is_set():  # again after a wake-up: another update may have closed the gate since
            await self._open.wait()
        if self.unknown is not None:
            raise WeightsUnknown(self.unknown)
        # No await between the check above and the count below: an update cannot slip in between.
        self.in_flight += 1
        self._idle.clear()
        try:
            yield self.version
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def update(self, version: int, load: Callable[[], Awaitable[T]]) -> T:
        """Close the gate to new requests, wait for the ones in flight, run `load()` and open the gate on `version`;
        returns what `load` returned. A `load` that raises leaves the weights unknown unless its exception says
        otherwise. A caller cancelled while the update waits for requests cancels it (nothing was loaded); once
        `load` has begun, it runs on to its end in the background (the server is loading: requests stay held until
        it has answered, and the gate then knows which weights it serves), and the caller's cancellation is raised
        at once."""
        self._pending += 1
        self._open.clear()
        if self.preempts:
            self._preempt.set()
        began = False

        async def run() -> T:
            nonlocal began
            try:
                async with self._one:
                    self._draining += 1
                    try:
                        await self._idle.wait()  # no request can start now, so once idle it stays idle
                    finally:
                        self._draining -= 1
                    began = True
                    try:
                        result = await load()
                    except BaseException as exc:
                        if not getattr(exc, "weights_unchanged", False):
                            self.unknown = f"loading weights v{version} failed part-way: {type(exc).__name__}: {exc}"
                        raise
                    self.version, self.unknown = version, None
                    return result
            finally:
                self._pending -= 1
                if self._pending == 0:
                    self._preempt = asyncio.Event()  # the requests let in now are called back by the next update
                    self._open.set()

        task = asyncio.ensure_future(run())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not began:
                task.cancel()
            task.add_done_callback(_retrieve)  # its outcome is the gate's now; nobody awaits it
            raise


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
