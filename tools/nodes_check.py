"""Static checks of training across nodes (a part of `make infra-check`): the sao-gpu-k8s pool's jobs, the headless
Service of infra/k8s/train.yaml and the deployments' launch commands agree, so the pods of one job form one torchrun
world (flows/launch.py, docs/production.md "Beyond one node").

- the pool's job is an indexed Job whose `completions` and `parallelism` are the job variable `nodes`, and its pods
  set `subdomain` to a headless Service that selects them and publishes names before the pods are ready (node 0
  must resolve while every pod is still starting);
- a deployment's `--nnodes` is its pool's `nodes` (a Job of 4 pods under `--nnodes 2` waits for ever; under
  `--nnodes 8` the rendezvous never completes), `--nproc-per-node` its `gpus`, and the launch is
  `python -m flows.launch` (the docker pool runs one container on one host: one node there);
- every NetworkPolicy of infra/k8s/ that selects the jobs' pods admits them to each other on the rendezvous port and
  on the ports they bind as port 0 (the world's store, gloo and NCCL).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from flows.launch import RDZV_PORT
from tools.k8s_check import (
    POOL_LABEL,
    TRAINER_POOL,
    _arg,
    _blocked,
    _job_pod,
    _port_range,
    _selects,
    _trainer_pool,
)

LAUNCH = ["python", "-m", "flows.launch"]
NODES = "{{ nodes }}"


def _all_docs(root: Path) -> list[tuple[str, dict]]:
    return [
        (str(path.relative_to(root)), doc)
        for path in sorted((root / "infra" / "k8s").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if isinstance(doc, dict)
    ]


def check_nodes(root: Path) -> list[str]:
    pool = _trainer_pool(root)
    where = f"infra/work-pools.yaml: {TRAINER_POOL}"
    spec = pool.get("job_configuration", {}).get("job_manifest", {}).get("spec", {})
    problems = []
    if "nodes" not in (pool.get("variables") or {}):
        problems.append(f"{where}: no job variable `nodes` (pods of a job, one per node)")
    if spec.get("completionMode") != "Indexed":
        problems.append(
            f"{where}: job_manifest.spec.completionMode is {spec.get('completionMode')!r}, not 'Indexed': its pods get "
            "no index and no stable name to find node 0 by"
        )
    for field in ("completions", "parallelism"):
        if spec.get(field) != NODES:
            problems.append(f"{where}: job_manifest.spec.{field} is {spec.get(field)!r}, not {NODES!r}")
    pod = _job_pod(pool)
    labels = {POOL_LABEL: TRAINER_POOL, **(pod.get("metadata", {}).get("labels") or {})}
    docs = _all_docs(root)
    problems += _service(where, (pod.get("spec") or {}).get("subdomain"), labels, docs)
    problems += _commands(root)
    span, more = _port_range(pod.get("spec") or {}, f"{where}: job_manifest: spec.template.spec")
    policies = [d for _, d in docs if d.get("kind") == "NetworkPolicy"]
    for low, high, what in ((RDZV_PORT, RDZV_PORT, "the rendezvous"), (*span, "the world's store, gloo and NCCL")):
        problems += [
            f"infra/k8s: {reason}, not on {low}-{high} ({what}): the nodes of a job could not form their world"
            for reason in _blocked(policies, labels, labels, (low, high), {})
        ]
    return problems + more


def _service(where: str, subdomain: str | None, labels: dict, docs: list[tuple[str, dict]]) -> list[str]:
    if not subdomain:
        return [f"{where}: job_manifest: spec.template.spec.subdomain is not set: the pods' names do not resolve"]
    found = [(rel, d) for rel, d in docs if d.get("kind") == "Service" and d["metadata"].get("name") == subdomain]
    if not found:
        return [f"{where}: subdomain {subdomain!r} is no Service of infra/k8s/ (infra/k8s/train.yaml)"]
    rel, service = found[0]
    spec = service.get("spec") or {}
    problems = []
    if spec.get("clusterIP") != "None":
        problems.append(f"{rel}: Service {subdomain}: must be headless (clusterIP: None) to name each pod")
    if not spec.get("selector") or not _selects({"matchLabels": spec["selector"]}, labels):
        problems.append(
            f"{rel}: Service {subdomain}: its selector {spec.get('selector')} does not select the jobs' pods"
        )
    if not spec.get("publishNotReadyAddresses"):
        problems.append(
            f"{rel}: Service {subdomain}: publishNotReadyAddresses is not true: node 0's name resolves only once it is "
            "ready, while the other pods already look for it"
        )
    return problems


def _commands(root: Path) -> list[str]:
    """Each GPU deployment's launch agrees with its pool's nodes and GPUs."""
    pools = {p["name"]: p for p in yaml.safe_load((root / "infra" / "work-pools.yaml").read_text())["pools"]}
    problems = []
    for d in yaml.safe_load((root / "infra" / "prefect.yaml").read_text()).get("deployments", []):
        pool = d.get("work_pool") or {}
        variables = pool.get("job_variables") or {}
        command = variables.get("command")
        if not command or not pool.get("name", "").startswith("sao-gpu"):
            continue
        where = f"infra/prefect.yaml: deployment {d['name']} ({d['entrypoint']})"
        args = shlex.split(command)
        if args[:3] != LAUNCH:
            problems.append(f"{where}: command {command!r} is not `python -m flows.launch ...` (flows/launch.py)")
            continue
        defaults = (pools.get(pool["name"], {}).get("variables") or {}).get("nodes", {}).get("default", 1)
        nodes = variables.get("nodes", defaults) if pool["name"] == TRAINER_POOL else 1
        launched = _arg(args, "--nnodes") or "1"
        if int(launched) != nodes:
            problems.append(
                f"{where}: --nnodes {launched} is not its job's {nodes} node(s)"
                + ("" if pool["name"] == TRAINER_POOL else f" (the {pool['name']} pool runs one container on one host)")
            )
        gpus = variables.get("gpus")
        nproc = _arg(args, "--nproc-per-node") or "gpu"
        if isinstance(gpus, int) and gpus > 0 and nproc != str(gpus):
            problems.append(f"{where}: --nproc-per-node {nproc} is not its {gpus} GPUs per node")
    return problems
