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
  trainer loads the directory's config.json unchanged, so an override there would be a different model.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import yaml

from components.config import load_config

GPU_PRESETS = ("qwen3-30b-a3b", "qwen3-30b-a3b-coding")
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
    return problems


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
