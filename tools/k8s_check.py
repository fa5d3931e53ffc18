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
  reads) take no key at all, so only the network keeps them to the trainer;
- where a GPU preset sends weights over a process group (`rollout.weight_transfer = "collective"`), it can form
  past every NetworkPolicy selecting either side: the trainer reaches the servers' ephemeral ports (NCCL binds port
  0, from the pod's `net.ipv4.ip_local_port_range`; its bootstrap root, the trainer's rank 0, connects back to each
  server), the servers the trainer's (its store, NCCL); both sides set the same `NCCL_*`, from one ConfigMap;
- the `sao-gpu-k8s` jobs mount the presets' `model.path` read-only, from the servers' claim, at the same path.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

from components.config import Config, ConfigError

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
PORT_RANGE = "net.ipv4.ip_local_port_range"
KERNEL_PORT_RANGE = (32768, 60999)
"""The kernel's `net.ipv4.ip_local_port_range` for a new network namespace: where a pod without the sysctl binds
port 0 (NCCL's and gloo's listeners, the trainer's rendezvous store)."""
NCCL_REQUIRED = {
    "NCCL_SOCKET_IFNAME": "the interface NCCL's bootstrap and sockets use, the pod network's",
    "NCCL_IB_DISABLE": "the transport: 1 for sockets over the pod network, 0 for InfiniBand/RoCE with RDMA devices",
    "NCCL_DEBUG": "WARN: errors, and the `NCCL version` line each side logs as its communicator forms",
}
"""The NCCL settings both sides of the weight transfer's group must set, and why."""
TO_SERVERS = (
    f"the servers' ephemeral ports ({PORT_RANGE}), where the trainer's rank 0 (NCCL's bootstrap root) connects "
    "back to each server and NCCL's ring and sockets connect (NCCL cannot be told which ports: NVIDIA/nccl#388)"
)
TO_TRAINER = (
    f"the trainer's ephemeral ports ({PORT_RANGE}), where each server reaches its rendezvous store "
    "(rollout.transfer_address, a port chosen free) and NCCL connects the other way"
)
NCCL_VERSION_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
"""NCCL_DEBUG levels at which NCCL logs its version when a communicator forms (src/init.cc, `showVersion`)."""
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

    configs = _presets(root)
    for preset, cfg in configs.items():
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
    collective = [p for p, cfg in configs.items() if cfg.rollout.weight_transfer == "collective"]
    if collective:
        why = f'components/presets/{collective[0]}.toml\'s rollout.weight_transfer = "collective"'
        problems += _transfer_ports(root, docs, sts, container, why)
        problems += _nccl(root, docs, sts, container, why)
    problems += _models(root, configs, sts, mounts)
    return problems


def _presets(root: Path) -> dict[str, Config]:
    """The GPU presets of `root`, loaded as `load_config` loads them."""
    configs = {}
    for preset in GPU_PRESETS:
        path = root / "components" / "presets" / f"{preset}.toml"
        try:
            configs[preset] = Config(**{"name": preset, **tomllib.loads(path.read_text())})
        except (OSError, tomllib.TOMLDecodeError, ConfigError):
            continue  # check_presets (tools/infra_check.py) reports it
    return configs


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
        and "Ingress" in _policy_types(d)
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
    ranges = _rule_ports(rule, {"http": port} if port is not None else {})
    return port is not None and _covers(ranges, port, port) and _peers_match(rule.get("from"), labels)


def _peers_match(peers: list | None, labels: dict) -> bool:
    """Whether a rule's `from` (or `to`) holds pods with `labels` in the policy's own namespace (none: every peer;
    an ipBlock or a namespaceSelector is not judged: False)."""
    return not peers or any(
        "namespaceSelector" not in p and "ipBlock" not in p and _selects(p.get("podSelector") or {}, labels)
        for p in peers
    )


def _rule_ports(rule: dict, named: dict[str, int]) -> list[tuple[int, int]]:
    """The TCP port ranges an ingress or egress rule admits, inclusive (no `ports`: all of them; `named`: the
    destination container's named ports; a name it lacks admits nothing)."""
    ranges = []
    for entry in rule.get("ports") or [{}]:
        port = named.get(entry.get("port"), entry.get("port"))
        if entry.get("protocol", "TCP") == "TCP" and (port is None or isinstance(port, int)):
            ranges.append((1, 65535) if port is None else (port, int(entry.get("endPort", port))))
    return ranges


def _covers(ranges: list[tuple[int, int]], low: int, high: int) -> bool:
    """Whether the union of `ranges` holds every port from `low` to `high`."""
    for start, end in sorted(ranges):
        if start <= low <= end:
            low = end + 1
    return low > high


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


def _trainer_pool(root: Path) -> dict:
    pools = yaml.safe_load((root / "infra" / "work-pools.yaml").read_text()).get("pools") or []
    return next((p for p in pools if p.get("name") == TRAINER_POOL), {})


def _job_pod(pool: dict) -> dict:
    """The pod template of a kubernetes pool's job manifest."""
    return pool.get("job_configuration", {}).get("job_manifest", {}).get("spec", {}).get("template", {})


def _job_pod_labels(root: Path) -> dict:
    """Labels the sao-gpu-k8s pool's job template puts on its pods itself (prefect-kubernetes adds the pool's)."""
    return _job_pod(_trainer_pool(root)).get("metadata", {}).get("labels") or {}


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
    containers = _job_pod(_trainer_pool(root)).get("spec", {}).get("containers") or [{}]
    job_paths = {m.get("mountPath") for m in containers[0].get("volumeMounts", [])}
    for path, mount in mounts.items():
        if mount.get("readOnly") and path.startswith("/shared") and path not in job_paths:
            problems.append(
                f"infra/work-pools.yaml: sao-gpu-k8s jobs do not mount {path}, where the trainer "
                f"publishes the weights the servers of infra/k8s/vllm.yaml read"
            )
    return problems


# ---- the weight transfer's process group and the model directory ------------------------------------------------


def _port_range(pod: dict, where: str) -> tuple[tuple[int, int], list[str]]:
    """The ports a pod binds port 0 in (its `net.ipv4.ip_local_port_range` sysctl, else the kernel's default)."""
    sysctls = {s.get("name"): s.get("value") for s in (pod.get("securityContext") or {}).get("sysctls") or []}
    if PORT_RANGE not in sysctls:
        return KERNEL_PORT_RANGE, []
    bounds = [int(b) for b in re.findall(r"\d+", str(sysctls[PORT_RANGE]))]
    if len(bounds) != 2 or not 0 < bounds[0] <= bounds[1] <= 65535:
        return KERNEL_PORT_RANGE, [
            f"{where}.securityContext.sysctls: {PORT_RANGE} {sysctls[PORT_RANGE]!r}: not LOW HIGH"
        ]
    return (bounds[0], bounds[1]), []


def _blocked(policies: list[dict], src: dict, dst: dict, span: tuple[int, int], named: dict) -> list[str]:
    """Why pods labelled `src` cannot open connections to pods labelled `dst` on every port of `span` (none: they
    can). Kubernetes adds up the policies that select a pod: those selecting `dst` for ingress must together admit
    `src`, those selecting `src` for egress must together admit `dst`. Each reason names the policies and field."""
    reasons = []
    for kind, subject, peer, key in (("ingress", dst, src, "from"), ("egress", src, dst, "to")):
        specs = [p.get("spec") or {} for p in policies if kind.capitalize() in _policy_types(p)]
        chosen = [s for s in specs if _selects(s.get("podSelector") or {}, subject)]
        rules = [rule for s in chosen for rule in s.get(kind) or [] if _peers_match(rule.get(key), peer)]
        ranges = sorted(r for rule in rules for r in _rule_ports(rule, named))
        if chosen and not _covers(ranges, *span):
            names = ", ".join(str(p.get("metadata", {}).get("name")) for p in policies if p.get("spec") in chosen)
            shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) or "no port"
            reasons.append(f"NetworkPolicy {names}: spec.{kind} admits pods {src} to pods {dst} on TCP {shown} only")
    return reasons


def _policy_types(policy: dict) -> list[str]:
    """A policy's policyTypes (unset: Ingress, and Egress when it has egress rules, as Kubernetes reads it)."""
    spec = policy.get("spec") or {}
    return spec.get("policyTypes") or (["Ingress", "Egress"] if spec.get("egress") else ["Ingress"])


def _transfer_ports(root: Path, docs: list[dict], sts: dict, container: dict, why: str) -> list[str]:
    """The transfer group can form: trainer -> server on the servers' ephemeral ports, server -> trainer on the
    trainer's, past every NetworkPolicy of the manifest that selects either side, for ingress or egress."""
    rel, template = "infra/k8s/vllm.yaml", sts.get("spec", {}).get("template", {})
    servers = template.get("metadata", {}).get("labels") or {}
    trainer = {POOL_LABEL: TRAINER_POOL, **_job_pod_labels(root)}
    server_span, problems = _port_range(
        template.get("spec", {}), f"{rel}: StatefulSet {sts['metadata'].get('name')}: spec.template.spec"
    )
    job = _job_pod(_trainer_pool(root)).get("spec", {})
    trainer_span, more = _port_range(job, f"infra/work-pools.yaml: {TRAINER_POOL}: job_manifest: spec.template.spec")
    namespace = sts.get("metadata", {}).get("namespace")
    policies = [
        d for d in docs if d.get("kind") == "NetworkPolicy" and d.get("metadata", {}).get("namespace") == namespace
    ]
    named = {p["name"]: p.get("containerPort") for p in container.get("ports") or [] if p.get("name")}
    for src, dst, span, dst_named, what in (
        (trainer, servers, server_span, named, TO_SERVERS),
        (servers, trainer, trainer_span, {}, TO_TRAINER),
    ):
        problems += [
            f"{rel}: {reason}, not on {span[0]}-{span[1]}, {what}: {why} would hang forming its group"
            for reason in _blocked(policies, src, dst, span, dst_named)
        ]
    return problems + more


def _nccl_env(container: dict, maps: dict[str, dict], where: str) -> tuple[dict[str, str], list[str]]:
    """The NCCL_* variables a container gets: from ConfigMaps of the manifest (envFrom), then its `env`, which wins."""
    env, problems = {}, []
    for source in container.get("envFrom") or []:
        name = (source.get("configMapRef") or {}).get("name")
        if "configMapRef" in source and name not in maps:
            problems.append(f"{where}: envFrom configMapRef {name}: no such ConfigMap in infra/k8s/vllm.yaml")
        elif "configMapRef" in source:  # a ConfigMap's keys, under the source's prefix
            prefix = source.get("prefix") or ""
            env |= {prefix + k: str(v) for k, v in maps[name].items() if (prefix + k).startswith("NCCL_")}
    for var in container.get("env") or []:
        if str(var.get("name", "")).startswith("NCCL_"):
            env[var["name"]] = str(var["value"]) if "value" in var else "<valueFrom>"
    return env, problems


def _nccl(root: Path, docs: list[dict], sts: dict, container: dict, why: str) -> list[str]:
    """Both sides of the transfer group set NCCL_REQUIRED, NCCL_DEBUG at a level that logs NCCL's version, and
    every NCCL_* variable alike (a deployment's job variables override the pool's ConfigMap in the trainer's pods)."""
    maps = {d.get("metadata", {}).get("name"): d.get("data") or {} for d in docs if d.get("kind") == "ConfigMap"}
    job = (_job_pod(_trainer_pool(root)).get("spec", {}).get("containers") or [{}])[0]
    server_where = f"infra/k8s/vllm.yaml: StatefulSet {sts['metadata'].get('name')}: container {container.get('name')}"
    job_where = f"infra/work-pools.yaml: {TRAINER_POOL}: job_manifest: container"
    server, problems = _nccl_env(container, maps, server_where)
    trainer, more = _nccl_env(job, maps, job_where)
    for where, env in ((server_where, server), (job_where, trainer)):
        problems += [
            f"{where}: {name} is not set ({meaning}): {why} forms an NCCL group between the trainer and each server; "
            f"set it in the ConfigMap both sides take (envFrom)"
            for name, meaning in NCCL_REQUIRED.items()
            if name not in env
        ]
        if env.get("NCCL_DEBUG", "WARN").upper() not in NCCL_VERSION_LEVELS:
            problems.append(
                f"{where}: NCCL_DEBUG={env['NCCL_DEBUG']!r} logs no `NCCL version` line, which is how the NCCL builds of "
                f"the trainer image's torch and of vLLM are compared: use one of {', '.join(NCCL_VERSION_LEVELS)}"
            )
    sides = [(job_where, trainer, set(server) | set(trainer))]
    for d in yaml.safe_load((root / "infra" / "prefect.yaml").read_text()).get("deployments") or []:
        pool = d.get("work_pool") or {}
        env = ((pool.get("job_variables") or {}).get("env") or {}) if pool.get("name") == TRAINER_POOL else {}
        if over := {k: str(v) for k, v in env.items() if str(k).startswith("NCCL_")}:  # `env` beats envFrom
            where = f"infra/prefect.yaml: deployment {d.get('name')} ({d.get('entrypoint')}): job_variables.env"
            sides.append((where, trainer | over, set(over)))
    for where, env, names in sides:
        problems += [
            f"{where}: {name}={env.get(name)!r}, but the vLLM servers (infra/k8s/vllm.yaml) have "
            f"{server.get(name)!r}: both sides of the transfer group must use the same NCCL settings"
            for name in sorted(names)
            if server.get(name) != env.get(name) and (name not in NCCL_REQUIRED or name in server.keys() & env.keys())
        ]
    return problems + more


def _claim(volumes: list[dict], mount: dict, variables: dict) -> tuple[str | None, str | None]:
    """(claim, mount path) of a volume mount; a claim written `{{ variable }}` reads as the job variable's default."""
    volume = next((v for v in volumes if v.get("name") == mount.get("name")), {})
    claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
    var = re.fullmatch(r"\{\{\s*(\w+)\s*\}\}", str(claim))
    return ((variables.get(var[1]) or {}).get("default") if var else claim), mount.get("mountPath")


def _models(root: Path, configs: dict[str, Config], sts: dict, mounts: dict[str, Any]) -> list[str]:
    """The sao-gpu-k8s jobs (training, evaluation) load each GPU preset's model.path: a read-only mount holds it,
    of the claim the servers read it from, at the same path."""
    where, pool = f"infra/work-pools.yaml: {TRAINER_POOL}: job_manifest", _trainer_pool(root)
    pod = _job_pod(pool).get("spec", {})
    job_mounts = {m.get("mountPath"): m for m in ((pod.get("containers") or [{}])[0].get("volumeMounts") or [])}
    server_volumes = sts.get("spec", {}).get("template", {}).get("spec", {}).get("volumes") or []
    problems = []
    for preset, path in ((p, cfg.model.path) for p, cfg in configs.items() if cfg.model.path):
        served, mount = _mount_holding(mounts, path), _mount_holding(job_mounts, path)
        theirs = _claim(server_volumes, served, {}) if served is not None else (None, None)
        ours = _claim(pod.get("volumes") or [], mount, pool.get("variables") or {}) if mount is not None else None
        if mount is None or not mount.get("readOnly"):
            problems.append(
                f"{where}: no read-only volume mount holds components/presets/{preset}.toml's model.path {path}, "
                f"which the training and evaluation jobs load: mount the servers' claim {theirs[0]} at {theirs[1]}, read-only"
            )
        elif served is not None and ours != theirs:
            problems.append(
                f"{where}: components/presets/{preset}.toml's model.path {path} is on claim {ours[0]} at {ours[1]} "
                f"(volumes, variables), the vLLM servers read it from claim {theirs[0]} at {theirs[1]}: the trainer "
                f"would train another directory than the servers serve"
            )
    return problems
