"""`EnginePool` when servers fail part-way: what a half-done request leaves behind (nothing), and how long
requests wait once every server is down. Scripted servers on real loopback sockets, so that each failure is
exactly the one named; tests/rollout/test_backends.py SIGKILLs real engines, tests/training/test_engine_faults.py
does it under the trainer."""

import asyncio
import contextlib
import socket
import threading
import time

import pytest
from fastapi import FastAPI

from components.rollout.client import EngineClient
from components.rollout.pool import EnginePool, EnginesDown
from components.rollout.protocol import SamplingRequest
from components.rollout.server import ServerThread
from tests.conftest import free_port

REQUEST = SamplingRequest([1, 2, 3], max_tokens=8, seed=0)


def _completion(token_ids: list[int], versions: list[int], finish_reason: str) -> dict:
    """A completion in the shape `sao engine serve` answers (one log-prob of -0.5 per token)."""
    return {
        "choices": [
            {
                "token_ids": token_ids,
                "versions": versions,
                "finish_reason": finish_reason,
                "logprobs": {"token_logprobs": [-0.5] * len(token_ids)},
            }
        ]
    }


def _scripted(answer: dict, calls: list[int]) -> FastAPI:
    """A healthy server that answers every completion with `answer`, counting them in `calls`."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "version": 0}

    @app.post("/v1/completions")
    async def completions() -> dict:
        calls.append(1)
        return answer

    return app


@contextlib.contextmanager
def _hang_up(calls: list[int]):
    """A server that reads a request and closes the connection without answering: an engine that died while
    generating it. Yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                calls.append(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        thread.join(timeout=5)
        listener.close()


@contextlib.contextmanager
def _failing(kind: str, calls: list[int]):
    """The first server of the pool, failing the request half-way: `abort` answers with the 2 tokens it had
    generated at version 7 (a server shutting down), `hang_up` drops the connection."""
    if kind == "hang_up":
        with _hang_up(calls) as url:
            yield url
    else:
        with ServerThread(_scripted(_completion([9, 9], [7, 7], "abort"), calls)) as url:
            yield url


@pytest.mark.parametrize("kind", ["abort", "hang_up"])
def test_a_half_done_request_is_answered_whole_by_the_next_server(kind):
    failing_calls, good_calls = [], []
    # The server that finishes the request sampled its tokens under versions 2, 2 and 3 (weights changed
    # mid-request); the answer must carry exactly that record, nothing of the failed server's.
    good = ServerThread(_scripted(_completion([5, 6, 7], [2, 2, 3], "stop"), good_calls))
    with _failing(kind, failing_calls) as bad_url, good as good_url:

        async def run():
            pool = EnginePool([EngineClient(bad_url, retries=0), EngineClient(good_url, retries=0)], revive_after_s=60)
            try:
                result = await pool.generate(REQUEST)
                return result, pool.errors, [(s.up, s.served) for s in pool.servers]
            finally:
                await pool.aclose()

        result, errors, servers = asyncio.run(run())
    # Both idle: the first server's turn. It fails once, is taken down, and the same request goes to the second.
    assert failing_calls == [1] and good_calls == [1]
    assert (result.token_ids, result.versions, result.finish_reason) == ([5, 6, 7], [2, 2, 3], "stop")
    assert result.logprobs == [-0.5] * 3 and result.prompt_ids == [1, 2, 3]
    assert errors == 1 and servers == [(False, 0), (True, 1)]


def test_with_every_server_down_requests_give_up_together_then_a_probe_revives_one():
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there yet

    async def run():
        pool = EnginePool([EngineClient(url, retries=0) for url in urls], revive_after_s=0.2, max_wait_s=1.0)
        start = time.monotonic()

        async def timed(delay: float) -> tuple[float, str]:
            await asyncio.sleep(delay)
            with pytest.raises(EnginesDown) as down:
                await pool.generate(REQUEST)
            return time.monotonic() - start, str(down.value)

        try:
            (first, message), (second, _) = await asyncio.gather(timed(0.0), timed(0.3))
            calls: list[int] = []
            with ServerThread(_scripted(_completion([4], [0], "stop"), calls), port=int(urls[1].rsplit(":", 1)[1])):
                # Its next probe is due 1.4 s into the outage; a request after that revives it and is served.
                await asyncio.sleep(max(0.0, 1.5 - (time.monotonic() - start)))
                result = await pool.generate(REQUEST)
            return first, second, message, result, calls, pool.down_since
        finally:
            await pool.aclose()

    first, second, message, result, calls, down_since = asyncio.run(run())
    # Both servers fail the first request at t=0: the outage starts, the wait ends at t=1.0. Probes (back-off
    # 0.2 s, doubling per failure) at t=0.2 and t=0.6 fail; the next would be at 0.6 + 0.8 = 1.4 > 1.0, so at
    # t=0.6 there is nothing left to wait for. The request sent at t=0.3 gives up with the first one.
    assert 0.55 <= first < 1.0 and abs(second - first) < 0.15
    assert message.startswith("every engine server is down: waited 0.")
    assert "(no probe is due within rollout.engine_wait_s = 1 s)" in message
    assert all(f"{url} (revival: ConnectionError: no answer on /health; next probe in " in message for url in urls)
    assert result.token_ids == [4] and calls == [1] and down_since is None
