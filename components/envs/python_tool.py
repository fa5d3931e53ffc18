"""The Python tool of tool-integrated reasoning: model-written code runs in the sandbox, and its result
becomes the observation text the model sees next."""

from __future__ import annotations

from components.sandbox.run import DEFAULT_PACKAGES, SandboxResult, run_python


def observation_from_result(result: SandboxResult, max_chars: int = 256) -> str:
    """stdout on success; otherwise a one-line error (the last stderr line, or the limit that was hit)."""
    if result.timed_out:
        text = "TimeoutError: the tool call exceeded its time limit\n"
    elif result.memory_exceeded:
        text = "MemoryError: the tool call exceeded its memory limit\n"
    elif result.exit_code != 0:
        lines = result.stderr.strip().splitlines()
        text = (lines[-1] if lines else f"exit code {result.exit_code}") + "\n"
    else:
        text = result.stdout
    return text if len(text) <= max_chars else text[:max_chars] + "...\n"


class PythonTool:
    """Callable tool runner: `tool(code) -> observation text`.

    `timeout_s` is each call's wall-clock limit, `max_chars` the longest observation, `packages` the top-level
    import names the code may import besides the standard library (`run_python`'s allow-list).
    """

    def __init__(
        self, timeout_s: float = 5.0, max_chars: int = 256, packages: tuple[str, ...] = DEFAULT_PACKAGES
    ) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.packages = packages

    def __call__(self, code: str) -> str:
        result = run_python(code, timeout_s=self.timeout_s, packages=self.packages)
        return observation_from_result(result, self.max_chars)
