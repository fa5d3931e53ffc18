"""The check a run makes before it runs model-written code: is the sandbox sealed, and if it is not, may the run go
on degraded? `rollout.sandbox_degraded` decides (docs/sandbox.md, "DEGRADED").

- `warn` (the default: `make run` on a laptop that is not root) lets a degraded sandbox run: the sandbox warns
  once at its first call (`RuntimeWarning` "sandbox degraded"), and each check adds a line naming the field to the
  run log.
- `refuse` (the GPU presets) stops the run with `SandboxRefused`, whose one line names the field and the reason the
  sandbox gives. When the namespaces are there it first runs one call, so that a container which allows `unshare`
  but not the rest of the seal (Docker's and containerd's default seccomp profiles refuse `pivot_root` even with
  CAP_SYS_ADMIN) stops the run here rather than at its first tool call.
"""

from __future__ import annotations

from collections.abc import Callable

from components.sandbox import SandboxError, degraded_reason, run_python

FIELD = "rollout.sandbox_degraded"
_FIRST_CALL_TIMEOUT_S = 30.0
"""The proving call's limit: `pass` takes milliseconds, but the first call of a process also plans the root and
starts the zygote, which a loaded host can make slow."""


class SandboxRefused(ValueError):
    """The config refuses a degraded sandbox (`rollout.sandbox_degraded = "refuse"`) and this host gives one, or one
    whose sealed call fails; the message names the field and the reason."""


def check_sandbox(mode: str, packages: tuple[str, ...], log: Callable[[str], None]) -> None:
    """Refuse (`mode` "refuse": `SandboxRefused`) or report (`mode` "warn": one `log` line) a sandbox that cannot
    seal model-written code in this process; `packages` is the run's allow-list (`rollout.tool_packages`), which
    the proving call of "refuse" imports nothing of but resolves, so a missing one is a `ValueError` here too."""
    reason = degraded_reason()
    if reason is None and mode == "refuse":
        reason = _sealed_call_problem(packages)
    if reason is None:
        return
    if mode == "refuse":
        raise SandboxRefused(
            f'{FIELD} = "refuse": the sandbox cannot seal model-written code here ({reason}); it needs root with '
            "CAP_SYS_ADMIN, and seccomp and AppArmor profiles that allow unshare, mount and pivot_root "
            f'(docs/sandbox.md, "In a container"), or {FIELD} = "warn" to run it degraded'
        )
    log(
        f"sandbox: DEGRADED ({reason}): model-written code runs without namespaces or the sealed root, as "
        f'{FIELD} = "warn" allows (docs/sandbox.md)'
    )


def _sealed_call_problem(packages: tuple[str, ...]) -> str | None:
    """Why one sealed call fails on this host, or None when it runs."""
    try:
        result = run_python("pass", timeout_s=_FIRST_CALL_TIMEOUT_S, packages=packages)
    except SandboxError as exc:
        return " ".join(str(exc).split())
    if result.exit_code != 0:
        return f"a sealed call of `pass` ended with exit code {result.exit_code}: {' '.join(result.stderr.split())}"
    return None
