"""A fault-injecting HTTP reverse proxy for tests: put it in front of a real endpoint (moto's S3 server, an
`mlflow server`) and give its `url` to the client under test instead of the endpoint's.

    with FaultProxy("http://127.0.0.1:5000") as proxy:
        client = make_client(proxy.url)
        proxy.mode("5xx", count=3)          # the next 3 requests get 503 SlowDown, then pass-through again
        proxy.mode("down")                  # every connection is closed without an answer, until...
        proxy.mode("pass")
        proxy.stop(); proxy.start()         # the listening socket itself goes away, then comes back (same port)
        proxy.stop_after(4, for_s=1.5)      # the same, from the 5th request on (exactly: no watcher to race)
        proxy.stats()                       # {"seen": .., "forwarded": .., "failed": ..}

Modes (`mode(name, ...)`; `count` limits it to the next N requests, `fraction` to a random share of them,
`duration_s` to a stretch of time, and `match` to requests whose "METHOD /path?query" contains that text, e.g.
"partNumber=" for S3's multipart UploadPart; the proxy returns to "pass" after):
  pass  forward the request, return the endpoint's answer
  down  read the request, then close the connection without an answer (a server that resets connections)
  5xx   answer `status` (503 with S3's SlowDown body by default) without forwarding
  slow  forward the request, then hold the answer `delay_s` seconds before sending it (a client with a
        shorter read timeout gives up; the endpoint has already applied the request, as a slow server would)
`stop()` closes the listening socket and every open connection (connection refused); `start()` listens on the
same port again (`stop(for_s=...)` does so by itself after that long). Every request is recorded in `log` as
(method, path, outcome).
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

MODES = ("pass", "down", "5xx", "slow")

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
_OWN = {"server", "date"}  # send_response writes its own

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    """A threaded reverse proxy to `target` (http://host:port) on 127.0.0.1, port `port` (0: any free one)."""

    def __init__(self, target: str, port: int = 0, seed: int = 0) -> None:
        parts = urlsplit(target)
        self.target = (parts.hostname, parts.port or 80)
        self.port = port
        self.log: list[tuple[str, str, str]] = []
        """(method, path, outcome) of every request, outcome one of forwarded / down / 5xx / slow."""
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._connections: set[socket.socket] = set()
        self._stop_countdown: tuple[int, float] | None = None
        self._away_until = 0.0  # a request reaching the proxy before this (monotonic) is closed unanswered
        self.mode("pass")

    # -- control -----------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def mode(
        self,
        name: str,
        *,
        count: int | None = None,
        fraction: float = 1.0,
        duration_s: float | None = None,
        match: str = "",
        status: int = 503,
        body: bytes = SLOW_DOWN,
        delay_s: float = 0.0,
    ) -> FaultProxy:
        """Switch to mode `name` (see the module docstring) for the next `count` matching requests or
        `duration_s` seconds (both None: until the next switch), each hit with probability `fraction`."""
        if name not in MODES:
            raise ValueError(f"FaultProxy mode must be one of {MODES}, got {name!r}")
        with self._lock:
            self._mode, self._left, self._fraction, self._match = name, count, fraction, match
            self._until = None if duration_s is None else time.monotonic() + duration_s
            self._status, self._body, self._delay = status, body, delay_s
        return self

    def stats(self) -> dict[str, int]:
        """Requests seen, forwarded (answered by the endpoint, "slow" included) and failed by the proxy."""
        with self._lock:
            outcomes = [outcome for _, _, outcome in self.log]
        forwarded = outcomes.count("forwarded") + outcomes.count("slow")
        return {"seen": len(outcomes), "forwarded": forwarded, "failed": outcomes.count("down") + outcomes.count("5xx")}

    def reset_stats(self) -> None:
        with self._lock:
            self.log.clear()

    def start(self) -> FaultProxy:
        """Listen (again, on the same port after `stop`)."""
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name=f"faultproxy-{self.port}"
        ).start()
        return self

    def stop(self, for_s: float | None = None) -> None:
        """Close the listening socket and every open connection: clients now get connection refused. With
        `for_s`, listen again (same port) after that many seconds."""
        if for_s is not None:
            threading.Timer(for_s, self.start).start()
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop_after(self, requests: int, for_s: float) -> None:
        """Let the next `requests` requests through as the mode says, then go away for `for_s` seconds: the
        request after them is closed without an answer while the proxy `stop`s, later ones are refused until it
        listens again. Decided in the request path, so the outage starts at exactly that request however fast
        the client is. A request that still reaches the proxy before its socket is closed (the stop runs on a
        thread; a loaded machine may delay it) is closed unanswered too, until `for_s` has passed."""
        with self._lock:
            self._stop_countdown = (requests, for_s)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the request path --------------------------------------------------------------------------------------

    def _decide(self, method: str, path: str) -> str:
        """The outcome of one request under the current mode (and the mode's countdown)."""
        with self._lock:
            if time.monotonic() < self._away_until:
                self.log.append((method, path, "down"))
                return "down"
            if self._stop_countdown is not None:
                left, for_s = self._stop_countdown
                if left <= 0:
                    self._stop_countdown = None
                    self._away_until = time.monotonic() + for_s
                    threading.Thread(target=self.stop, args=(for_s,), daemon=True).start()
                    self.log.append((method, path, "down"))
                    return "down"
                self._stop_countdown = (left - 1, for_s)
            mode = self._mode
            if self._until is not None and time.monotonic() >= self._until:
                mode = self._mode = "pass"
            if self._match and self._match not in f"{method} {path}":
                mode = "pass"
            if mode != "pass" and self._left is not None:
                if self._left <= 0:
                    mode = self._mode = "pass"
                else:
                    self._left -= 1
            if mode != "pass" and self._fraction < 1.0 and self._rng.random() >= self._fraction:
                mode = "pass"
            outcome = "forwarded" if mode == "pass" else mode
            self.log.append((method, path, outcome))
            return outcome


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients under test expect

    def log_message(self, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._connections.add(self.connection)

    def finish(self) -> None:
        with self.owner._lock:
            self.owner._connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is not None:
            return self.rfile.read(int(length))
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = bytearray()
            while size := int(self.rfile.readline().split(b";")[0].strip(), 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline().strip():  # trailers
                pass
            return bytes(body)
        return b""

    def _serve(self) -> None:
        owner = self.owner
        body = self._read_body()
        outcome = owner._decide(self.command, self.path)
        if outcome == "down":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if outcome == "5xx":
            self._answer(owner._status, {"Content-Type": "application/xml"}, owner._body)
            return
        status, headers, data = self._forward(body)
        if outcome == "slow":
            time.sleep(owner._delay)
        try:
            self._answer(status, headers, data)
        except OSError:  # the client gave up waiting
            self.close_connection = True

    def _forward(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(*self.owner.target, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            out = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP | _OWN}
            if self.command != "HEAD":
                out = {k: v for k, v in out.items() if k.lower() != "content-length"}
                out["Content-Length"] = str(len(data))
            return response.status, out, data
        finally:
            conn.close()

    def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Length" not in headers and "content-length" not in {k.lower() for k in headers}:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _serve
