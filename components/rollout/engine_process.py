"""`sao engine serve` as a child process on a fixed loopback port: started, SIGKILLed and started again where its
clients expect it. The benchmarks, the soak (`make soak`) and the fault tests drive engines through this."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EngineProcess:
    """One `sao engine serve --model model_dir` child on `port` (default: a free one). Its output goes to a file
    (`log`, else a temporary one), never a pipe, so a chatty server can never block on a full pipe."""

    def __init__(
        self,
        model_dir: str | Path,
        port: int | None = None,
        threads: int | None = None,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        dtype: str = "float32",
    ) -> None:
        self.model_dir, self.port, self.threads, self.log, self.env, self.dtype = (
            Path(model_dir),
            port or free_port(),
            threads,
            log,
            env,
            dtype,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._output = None

    def start(self, timeout_s: float = 120.0, wait: bool = True) -> EngineProcess:
        """Start it and (with `wait`) return once `/health` answers. Several engines load in parallel when each
        is started with `wait=False` and then waited for (`wait_healthy`)."""
        command = [
            sys.executable,
            "-m",
            "components.cli",
            "engine",
            "serve",
            "--model",
            str(self.model_dir),
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
        ] + (["--threads", str(self.threads)] if self.threads else [])
        self._output = self.log.open("ab") if self.log else tempfile.TemporaryFile()
        self.proc = subprocess.Popen(command, stdout=self._output, stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Return once `/health` answers; RuntimeError with the output's tail when the process exits first or
        `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self._tail()
                self.kill()
                raise RuntimeError(f"sao engine serve on {self.url} did not start: {tail}")
            time.sleep(0.2)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def kill(self) -> None:
        """SIGKILL (a crash, not a shutdown) and reap it."""
        self.stop(graceful=False)

    def stop(self, graceful: bool = True) -> None:
        """SIGTERM (SIGKILL when not `graceful`) and reap it."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate() if graceful else self.proc.kill()
            self.proc.wait(timeout=30)
        if self._output is not None:
            self._output.close()
            self._output = None

    def _tail(self) -> str:
        if self.log:
            return self.log.read_bytes().decode(errors="replace")[-2000:]
        if self._output is None:
            return ""
        self._output.seek(0)
        return self._output.read().decode(errors="replace")[-2000:]
