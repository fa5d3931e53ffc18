"""`make deploy`: the work pools of infra/work-pools.yaml, then every deployment of infra/prefect.yaml, registered
against the Prefect server that `PREFECT_API_URL` names (`make server` starts a local one).

A pool starts from Prefect's default base job template for its type (so it keeps up with Prefect's worker
versions); the pool file adds job variables (`gpus`, `shm_size`, ...) and where they go in the job. Pools are
created or updated in place, so `make deploy` is safe to repeat. Deployments go through Prefect's own
`prefect deploy --all`, exactly as a person would run it.
"""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
POOLS_FILE = ROOT / "infra" / "work-pools.yaml"
PREFECT_FILE = ROOT / "infra" / "prefect.yaml"


class DeployError(RuntimeError):
    pass


def merge(base: Any, patch: Any) -> Any:
    """`patch` laid over `base`: dicts merge by key, lists of dicts by position (a job manifest's first
    container), anything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) for x in base + patch):
        return [merge(b, p) for b, p in zip(base, patch)] + copy.deepcopy(base[len(patch) :] or patch[len(base) :])
    return copy.deepcopy(patch)


def load_pools(path: Path = POOLS_FILE) -> list[dict]:
    """The pool definitions, each checked for the fields `make deploy` needs."""
    pools = (yaml.safe_load(path.read_text()) or {}).get("pools")
    if not isinstance(pools, list) or not pools:
        raise DeployError(f"{path}: 'pools' must be a non-empty list")
    for i, pool in enumerate(pools):
        for field in ("name", "type"):
            if not isinstance(pool.get(field), str) or not pool[field]:
                raise DeployError(f"{path}: pools[{i}].{field} must be a non-empty string")
        unknown = set(pool) - {"name", "type", "description", "concurrency_limit", "variables", "job_configuration"}
        if unknown:
            raise DeployError(f"{path}: pools[{i}] ({pool['name']}): unknown field(s) {sorted(unknown)}")
    return pools


async def job_template(pool: dict) -> dict:
    """Prefect's default base job template for the pool's type with the pool's variables and placements."""
    from prefect.workers.utilities import (
        get_default_base_job_template_for_infrastructure_type,
    )

    template = await get_default_base_job_template_for_infrastructure_type(pool["type"])
    if template is None:
        raise DeployError(f"work pool {pool['name']}: Prefect knows no default job template for type {pool['type']!r}")
    template = copy.deepcopy(template)
    template["variables"]["properties"].update(copy.deepcopy(pool.get("variables") or {}))
    template["job_configuration"] = merge(template["job_configuration"], pool.get("job_configuration") or {})
    return template


async def apply_pools(pools: list[dict]) -> list[str]:
    """Create each pool, or update its template, description and concurrency limit; returns their names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        for pool in pools:
            template = await job_template(pool)
            fields = {
                "description": pool.get("description"),
                "base_job_template": template,
                "concurrency_limit": pool.get("concurrency_limit"),
            }
            try:
                await client.read_work_pool(pool["name"])
            except ObjectNotFound:
                await client.create_work_pool(WorkPoolCreate(name=pool["name"], type=pool["type"], **fields))
            else:
                await client.update_work_pool(pool["name"], WorkPoolUpdate(**fields))
    return [p["name"] for p in pools]


def deploy_all(prefect_file: Path = PREFECT_FILE, root: Path = ROOT) -> None:
    """`prefect --no-prompt deploy --all` from the repository root. The process pool's runs cd to `$SAO_ROOT`: this
    checkout unless the environment names another (the compose worker's `/opt/sao`)."""
    env = {"SAO_ROOT": str(root), **os.environ}
    cmd = [
        str(Path(sys.executable).with_name("prefect")),
        "--no-prompt",
        "deploy",
        "--all",
        "--prefect-file",
        str(prefect_file),
    ]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise DeployError(f"prefect deploy failed ({done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}")


async def registered() -> list[str]:
    """One line per deployment on the server: flow/name, pool, schedules, triggers (what `make deploy` prints)."""
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        flows = {f.id: f.name for f in await client.read_flows()}
        automations = await client.read_automations()
        lines = []
        for d in sorted(await client.read_deployments(), key=lambda d: (flows.get(d.flow_id, ""), d.name)):
            schedules = ", ".join(s.schedule.cron for s in d.schedules if getattr(s.schedule, "cron", None))
            triggered = any(getattr(action, "deployment_id", None) == d.id for a in automations for action in a.actions)
            name = f"{flows.get(d.flow_id, '?')}/{d.name}"
            line = (
                f"  {name:<32} {d.work_pool_name:<15}"
                + (f" cron {schedules}" if schedules else "")
                + (" on sao.checkpoint.saved" if triggered else "")
            )
            lines.append(line.rstrip())
    return lines


def main() -> int:
    import flows  # noqa: F401  (offline settings before prefect is imported)

    if not os.environ.get("PREFECT_API_URL"):
        print(
            "sao: deploy: PREFECT_API_URL is not set: start a server with `make server` (or name yours)",
            file=sys.stderr,
        )
        return 2
    try:
        names = asyncio.run(apply_pools(load_pools()))
        print(f"work pools: {', '.join(names)}")
        deploy_all()
    except DeployError as exc:
        print(f"sao: deploy: {exc}", file=sys.stderr)
        return 2
    lines = asyncio.run(registered())
    print(f"deployments ({len(lines)}) at {os.environ['PREFECT_API_URL']}:", *lines, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
