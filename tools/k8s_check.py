"""Static checks of the kubernetes side: the vLLM servers of infra/k8s/vllm.yaml against the GPU presets and the
deployments and work pools that use them (a part of `make infra-check`).

- every `rollout.urls` entry of a GPU preset and of a GPU deployment's overrides is a server the StatefulSet makes
  (`http://<statefulset>-<i>.<headless service>:<port>`), and every server is listed;
- the servers mount the claim that holds `rollout.publish_dir` at the same path, read-only, and the training jobs of
  the `sao-gpu-k8s` pool mount it at that path too (the trainer writes there, the servers read);
- `--max-model-len` covers the presets' `rollout.max_total_tokens`;
- what is served is what the trainer trains: `--model` is the presets' `model.path` (the SFT policy's base, whose
  config.json the trainer loads; its weights are replaced by the trainer's version 0 before the first rollout) on a
  read-only mount, and no flag changes the served model's config (`--hf-overrides`, rope or dtype flags): the
  trainer loads the directory's config.json unchanged, so an override there would be a different model;
- who may drive the servers: vLLM's API key comes from a Secret (`--api-key $(VAR)` or `VLLM_API_KEY`, each from a
  `secretKeyRef`; never written in the manifest), and the servers sit behind a NetworkPolicy that admits only
  labelled pods, the sao-gpu-k8s jobs (the trainer) among them, and behind no NodePort or LoadBalancer. vLLM 0.32's
  key guards only paths under `/v1`, `/v2`, `/inference` and `/cohere` (`GUARDED_PREFIX` in
  vllm/entrypoints/serve/middleware/authenticate.py): `/invocations` (SageMaker's sampling route, always on) and the
  dev routes SAO's image turns on (VLLM_SERVER_DEV_MODE=1: `/collective_rpc` loads weights from any path the server
  reads) take no key at all, so only the network keeps them to the trainer.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from components.config import load_config

GPU_PRESETS = ("qwen3-30b-a3b", "qwen3-30b-a3b-coding")
TRAINER_POOL = "sao-gpu-k8s"
POOL_LABEL = "prefect.io/work-pool-name"
"""prefect-kubernetes (0.8) puts this label, with the pool's name, on the pods of every job it runs."""
GUARDED = ("/v1", "/v2", "/inference", "/cohere")
"""What vLLM 0.32's --api-key guards (vllm/entrypoints/serve/middleware/authenticate.py, `GUARDED_PREFIX`)."""
UNGUARDED = (
    "/invocations (the same sampling as /v1) and, with VLLM_SERVER_DEV_MODE=1, /collective_rpc (loads weights from "
    "any path the server reads), /reset_prefix_cache, /sleep, /pause and the other dev routes"
)
CONFIG_FLAGS = ("--hf-overrides", "--rope-scaling", "--rope-theta", "--dtype", "--quantization", "--hf-config-path")
"""vLLM flags that make the served model differ from the directory's config.json, which is what the trainer loads."""


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]


def _one(docs: list[dict], kind: str, where: str) -> dict:
    found = [d for d in docs if d.get("kind") == kind]
    if len(found) != 1:
        raise ValueError(f"{where}: expected one {kind}, found {len(found)}")
    return found[0]


def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None


def _mount_holding(mounts: dict[str, Any], path: str) -> dict | None:
    """The volume mount whose mount path holds `path`, if any."""
    return next((m for p, m in mounts.items() if p and path.startswith(p.rstrip("/") + "/")), None)


def _urls_in(overrides: list[str]) -> list[str] | None:
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "rollout.urls":
            return list(tomllib.loads(f"v = {value}")["v"])
    return None


def check_k8s(root: Path) -> list[str]:
    rel = "infra/k8s/vllm.yaml"
    path = root / rel
    if not path.is_file():
        return [f"{rel}: missing (the kubernetes GPU pool's rollout servers)"]
    docs = _docs(path)
    try:
        service, sts = _one(docs, "Service", rel), _one(docs, "StatefulSet", rel)
    except ValueError as exc:
        return [str(exc)]
    problems: list[str] = []
    spec = sts.get("spec", {})
    svc_name = service.get("metadata", {}).get("name")
    if service.get("spec", {}).get("clusterIP") != "None":
        problems.append(f"{rel}: Service {svc_name}: must be headless (clusterIP: None) to give each server a name")
    if spec.get("serviceName") != svc_name:
        problems.append(
            f"{rel}: StatefulSet.spec.serviceName {spec.get('serviceName')!r} is not the Service {svc_name!r}"
        )
    container = (spec.get("template", {}).get("spec", {}).get("containers") or [{}])[0]
    ports = [p.get("containerPort") for p in container.get("ports", [])]
    port = ports[0] if ports else None
    servers = {f"http://{sts['metadata']['name']}-{i}.{svc_name}:{port}" for i in range(int(spec.get("replicas", 0)))}
    mounts = {m.get("mountPath"): m for m in container.get("volumeMounts", [])}
    args = [str(a) for a in container.get("args", [])]
    max_len, served = _arg(args, "--max-model-len"), _arg(args, "--model")
    for flag in CONFIG_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in args):
            problems.append(
                f"{rel}: {flag} changes the served model's config, but the trainer loads the model directory's "
                f"config.json unchanged (rope, window, dtype): the servers would sample from another model; set it "
                f"in the directory's config.json, where both read it"
            )

    for preset in GPU_PRESETS:
        cfg = load_config(preset)
        where = f"components/presets/{preset}.toml"
        if set(cfg.rollout.urls) != servers:
            problems.append(
                f"{where}: rollout.urls {sorted(cfg.rollout.urls)} are not the servers {rel} makes {sorted(servers)}"
            )
        mount = _mount_holding(mounts, cfg.rollout.publish_dir)
        if mount is None or not mount.get("readOnly"):
            problems.append(
                f"{rel}: no read-only volume mount holds {where}'s rollout.publish_dir {cfg.rollout.publish_dir}"
            )
        if served != cfg.model.path:
            problems.append(
                f"{rel}: --model {served} is not {where}'s model.path {cfg.model.path}, the directory whose config "
                f"the trainer trains"
            )
        elif not (_mount_holding(mounts, served) or {}).get("readOnly"):
            problems.append(f"{rel}: no read-only volume mount holds --model {served}")
        if max_len is None or int(max_len) < cfg.rollout.max_total_tokens:
            problems.append(
                f"{rel}: --max-model-len {max_len} is below {where}'s rollout.max_total_tokens "
                f"{cfg.rollout.max_total_tokens}"
            )
    problems += _deployments(root, servers, mounts)
    problems += _access(root, docs, service, sts, container)
    return problems


def _access(root: Path, docs: list[dict], service: dict, sts: dict, container: dict) -> list[str]:
    """vLLM's API key from a Secret; a NetworkPolicy that admits only labelled pods, the trainer's among them, to
    what the key leaves open; no Service that exposes the servers beyond the cluster."""
    rel = "infra/k8s/vllm.yaml"
    problems = [f"{rel}: {p}" for p in _api_key_problems(container)]
    kind = service.get("spec", {}).get("type", "ClusterIP")
    if kind in ("NodePort", "LoadBalancer"):
        problems.append(
            f"{rel}: Service {service['metadata']['name']} is a {kind}: it exposes routes vLLM's --api-key does not "
            f"guard ({UNGUARDED}) beyond the cluster"
        )
    template = sts.get("spec", {}).get("template", {})
    policies = [
        d
        for d in docs
        if d.get("kind") == "NetworkPolicy"
        and d.get("metadata", {}).get("namespace") == sts.get("metadata", {}).get("namespace")
        and _selects(d.get("spec", {}).get("podSelector") or {}, template.get("metadata", {}).get("labels") or {})
        and "Ingress" in (d.get("spec", {}).get("policyTypes") or ["Ingress"])
    ]
    if not policies:
        return problems + [
            f"{rel}: no NetworkPolicy restricts ingress to the vLLM servers, and vLLM's --api-key guards only "
            f"{', '.join(GUARDED)}, not {UNGUARDED}: add one that admits only the {TRAINER_POOL} jobs' pods "
            f"({POOL_LABEL}: {TRAINER_POOL})"
        ]
    port = next(iter(p.get("containerPort") for p in container.get("ports") or []), None)
    trainer = {POOL_LABEL: TRAINER_POOL, **_job_pod_labels(root)}
    rules = [(p, i, rule) for p in policies for i, rule in enumerate(p.get("spec", {}).get("ingress") or [])]
    for policy, i, rule in rules:
        where = f"{rel}: NetworkPolicy {policy.get('metadata', {}).get('name')}: ingress rule {i}"
        if not rule.get("from"):
            problems.append(f"{where} admits every source (no `from`): only the trainer's pods may reach the servers")
        problems += [f"{where} {why}" for why in map(_open_peer, rule.get("from") or []) if why]
    if not any(_admits(rule, trainer, port) for _, _, rule in rules):
        problems.append(
            f"{rel}: no NetworkPolicy admits the {TRAINER_POOL} jobs' pods ({POOL_LABEL}: {TRAINER_POOL}) to port "
            f"{port}: the trainer could not reach its servers"
        )
    return problems


def _admits(rule: dict, labels: dict, port: int | None) -> bool:
    """Whether an ingress rule lets pods with `labels`, in the policy's own namespace, reach `port`."""
    ports = rule.get("ports") or []
    to_port = not ports or any(q.get("port") in (port, "http") for q in ports)
    peers = rule.get("from") or []  # none: every source
    return to_port and (
        not peers or any("namespaceSelector" not in p and _selects(p.get("podSelector") or {}, labels) for p in peers)
    )


def _api_key_problems(container: dict) -> list[str]:
    """vLLM reads its key from `--api-key` or, without it, `VLLM_API_KEY`: either must come from a Secret."""
    env = {e.get("name"): e for e in container.get("env") or []}
    args = [str(a) for a in container.get("args", [])]
    flag = _arg(args, "--api-key") or next((a.partition("=")[2] for a in args if a.startswith("--api-key=")), None)
    if flag is not None:
        source = re.fullmatch(r"\$\((\w+)\)", flag)
        if source is None:
            return ["--api-key is written in the manifest (committed with it): pass $(VAR), VAR from a secretKeyRef"]
        name, what = source[1], f"--api-key $({source[1]})"
    elif "VLLM_API_KEY" in env:
        name, what = "VLLM_API_KEY", "VLLM_API_KEY"
    else:
        return [
            "the vLLM server has no --api-key (nor VLLM_API_KEY): anyone who reaches it may sample from the policy "
            "(/v1/completions); take the key from a Secret (env VLLM_API_KEY, valueFrom.secretKeyRef)"
        ]
    ref = ((env.get(name) or {}).get("valueFrom") or {}).get("secretKeyRef") or {}
    if not ref.get("name") or not ref.get("key"):
        return [
            f"{what} does not come from a Secret (env {name}: valueFrom.secretKeyRef): a key in the manifest is "
            "committed with it"
        ]
    if ref.get("optional"):
        return [
            f"{what}: secretKeyRef {ref['name']}/{ref['key']} is optional: without the Secret vLLM starts with no key"
        ]
    return []


def _selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector's matchLabels all hold in `labels` (matchExpressions are not judged: False)."""
    if selector.get("matchExpressions"):
        return False
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _open_peer(peer: dict) -> str | None:
    """Why an ingress peer admits more than labelled pods (None: it does not)."""
    if "ipBlock" in peer:
        return f"admits addresses ({peer['ipBlock'].get('cidr')}), not labelled pods"
    pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
    if not (pods or {}).get("matchLabels") and not (pods or {}).get("matchExpressions"):
        return "admits every pod" + (" of the selected namespaces" if namespaces is not None else " of the namespace")
    if namespaces is not None and not namespaces.get("matchLabels") and not namespaces.get("matchExpressions"):
        return "admits matching pods of every namespace (an empty namespaceSelector)"
    return None


def _job_pod_labels(root: Path) -> dict:
    """Labels the sao-gpu-k8s pool's job template puts on its pods itself (prefect-kubernetes adds the pool's)."""
    pools = yaml.safe_load((root / "infra" / "work-pools.yaml").read_text()).get("pools") or []
    pool = next((p for p in pools if p.get("name") == TRAINER_POOL), {})
    manifest = pool.get("job_configuration", {}).get("job_manifest", {})
    return manifest.get("spec", {}).get("template", {}).get("metadata", {}).get("labels") or {}


def _deployments(root: Path, servers: set[str], mounts: dict[str, Any]) -> list[str]:
    """GPU deployments name the same servers; the k8s pool's jobs mount the publish directory's path."""
    problems = []
    prefect = yaml.safe_load((root / "infra" / "prefect.yaml").read_text())
    for d in prefect.get("deployments", []):
        pool = (d.get("work_pool") or {}).get("name", "")
        urls = _urls_in(list((d.get("parameters") or {}).get("overrides") or []))
        if pool.startswith("sao-gpu") and urls is not None and set(urls) != servers:
            problems.append(
                f"infra/prefect.yaml: deployment {d['name']} ({d['entrypoint']}): rollout.urls {urls} "
                f"are not the servers infra/k8s/vllm.yaml makes {sorted(servers)}"
            )
    pools = yaml.safe_load((root / "infra" / "work-pools.yaml").read_text())["pools"]
    k8s = next((p for p in pools if p["name"] == "sao-gpu-k8s"), {})
    containers = k8s.get("job_configuration", {}).get("job_manifest", {}).get("spec", {}).get("template", {}).get(
        "spec", {}
    ).get("containers") or [{}]
    job_paths = {m.get("mountPath") for m in containers[0].get("volumeMounts", [])}
    for path, mount in mounts.items():
        if mount.get("readOnly") and path.startswith("/shared") and path not in job_paths:
            problems.append(
                f"infra/work-pools.yaml: sao-gpu-k8s jobs do not mount {path}, where the trainer "
                f"publishes the weights the servers of infra/k8s/vllm.yaml read"
            )
    return problems
