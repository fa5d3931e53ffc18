"""Static checks that the containers which run model-written code keep the sandbox whole (a part of
`make infra-check`; docs/sandbox.md, "In a container").

The sandbox (components/sandbox) builds network, PID and mount namespaces and a sealed root, and drops each call to
nobody. In a container that needs root (uid 0), the capabilities of `SANDBOX_CAPS` and seccomp and AppArmor profiles
other than the runtimes' defaults: Docker's and containerd's default seccomp profiles have no `pivot_root` even with
CAP_SYS_ADMIN, and their AppArmor profiles deny every `mount`. Without them the sandbox runs degraded (not root, or
no CAP_SYS_ADMIN) or fails every call, and the GPU presets refuse to start. Checked:

- every docker and kubernetes work pool of infra/work-pools.yaml (their flow runs run environments) runs its job
  container as root, adds `SANDBOX_CAPS`, drops ALL the rest, sets both profiles and is not privileged;
- so does the compose service that serves the `sao-process` pool (flow runs execute inside it);
- every GPU preset refuses a degraded sandbox (`rollout.sandbox_degraded = "refuse"`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import yaml

from components.config import Config, ConfigError
from tools.k8s_check import GPU_PRESETS

SANDBOX_CAPS = ("SYS_ADMIN", "SETUID", "SETGID", "KILL", "DAC_OVERRIDE", "CHOWN")
"""What the sandbox needs beyond root, measured with tests/sandbox under a reduced bounding set: namespaces, mounts
and pivot_root; the drop to nobody (uid, then group); killing a call's processes; its per-call directories; and,
degraded (no namespaces, e.g. a host that refuses them), giving a call's directory to nobody."""
ROOT_USERS = ("0", "root", "0:0", "root:root")
WHERE = 'the sandbox needs it (docs/sandbox.md, "In a container")'


def _caps(names: Any) -> set[str]:
    return {str(n).upper().removeprefix("CAP_") for n in names or ()}


def _docker_problems(where: str, kwargs: dict) -> list[str]:
    """Problems of docker-py's container settings (a docker pool's `container_create_kwargs`, a compose service)."""
    problems = []
    if str(kwargs.get("user", "")) not in ROOT_USERS:
        problems.append(f'{where}: user is {kwargs.get("user")!r}, not root ("0"): {WHERE}')
    missing = [c for c in SANDBOX_CAPS if c not in _caps(kwargs.get("cap_add"))]
    if missing:
        problems.append(f"{where}: cap_add lacks {', '.join(missing)}: {WHERE}")
    if "ALL" not in _caps(kwargs.get("cap_drop")):
        problems.append(f"{where}: cap_drop must be [ALL]: the sandbox needs only {', '.join(SANDBOX_CAPS)}")
    options = {str(o).replace(":", "=", 1).partition("=")[::2] for o in kwargs.get("security_opt") or ()}
    for kind, default in (
        ("seccomp", "the default profile has no pivot_root"),
        ("apparmor", "docker-default denies mount"),
    ):
        if not any(key == kind and value not in ("", "builtin", "docker-default") for key, value in options):
            problems.append(f"{where}: security_opt lacks {kind}=unconfined (or a profile of yours): {default}")
    if kwargs.get("privileged") is True:
        problems.append(f"{where}: privileged: the sandbox needs only {', '.join(SANDBOX_CAPS)}")
    return problems


def _k8s_problems(where: str, pod: dict) -> list[str]:
    """Problems of a kubernetes job's pod spec (its first container, the flow run's)."""
    container = (pod.get("containers") or [{}])[0]
    pod_sc, sc = pod.get("securityContext") or {}, container.get("securityContext") or {}

    def field(name: str) -> Any:
        return sc.get(name, pod_sc.get(name))

    problems = []
    if field("runAsUser") != 0:
        problems.append(f"{where}: securityContext.runAsUser is {field('runAsUser')!r}, not 0: {WHERE}")
    caps = sc.get("capabilities") or {}
    missing = [c for c in SANDBOX_CAPS if c not in _caps(caps.get("add"))]
    if missing:
        problems.append(f"{where}: securityContext.capabilities.add lacks {', '.join(missing)}: {WHERE}")
    if "ALL" not in _caps(caps.get("drop")):
        problems.append(f"{where}: securityContext.capabilities.drop must be [ALL]")
    for name, default in (
        ("seccompProfile", "RuntimeDefault has no pivot_root"),
        ("appArmorProfile", "it denies mount"),
    ):
        if (field(name) or {}).get("type") not in ("Unconfined", "Localhost"):
            problems.append(f"{where}: securityContext.{name}.type must be Unconfined (or Localhost): {default}")
    if sc.get("privileged") is True:
        problems.append(f"{where}: securityContext.privileged: the sandbox needs only {', '.join(SANDBOX_CAPS)}")
    return problems


def _yaml(path: Path) -> dict:
    return (yaml.safe_load(path.read_text()) if path.is_file() else None) or {}


def check_containers(root: Path) -> list[str]:
    """The work pools, the compose service of the process pool and the GPU presets keep what the sandbox needs."""
    problems = []
    for pool in _yaml(root / "infra" / "work-pools.yaml").get("pools") or []:
        job, where = pool.get("job_configuration") or {}, f"infra/work-pools.yaml: {pool.get('name')}"
        if pool.get("type") == "docker":
            problems += _docker_problems(f"{where}: container_create_kwargs", job.get("container_create_kwargs") or {})
        elif pool.get("type") == "kubernetes":
            pod = job.get("job_manifest", {}).get("spec", {}).get("template", {}).get("spec", {})
            problems += _k8s_problems(f"{where}: job_manifest", pod)
    for name, service in (_yaml(root / "infra" / "compose.yaml").get("services") or {}).items():
        if "sao-process" in [str(word) for word in service.get("command") or ()]:
            problems += _docker_problems(f"infra/compose.yaml: service {name!r}", service)
    for preset in GPU_PRESETS:
        path = root / "components" / "presets" / f"{preset}.toml"
        try:
            cfg = Config(**{"name": preset, **tomllib.loads(path.read_text())})
        except (OSError, tomllib.TOMLDecodeError, ConfigError):
            continue  # check_presets reports it
        if cfg.rollout.sandbox_degraded != "refuse":
            problems.append(
                f"components/presets/{preset}.toml: rollout.sandbox_degraded is {cfg.rollout.sandbox_degraded!r}: a "
                'GPU run must refuse a degraded sandbox ("refuse")'
            )
    return problems
