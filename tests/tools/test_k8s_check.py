"""The kubernetes rollout servers (infra/k8s/vllm.yaml) stay in step with the GPU presets, the GPU deployments and
the k8s work pool; each check fails on a deliberately broken copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.factories import edit_once
from tools.k8s_check import check_k8s

ROOT = Path(__file__).resolve().parents[2]


def test_the_real_tree_is_consistent():
    assert check_k8s(ROOT) == []


@pytest.fixture
def tree(tmp_path):
    shutil.copytree(ROOT / "infra", tmp_path / "infra")
    shutil.copytree(ROOT / "components" / "presets", tmp_path / "components" / "presets")
    return tmp_path


@pytest.mark.parametrize(
    "file,old,new,message",
    [
        (
            "infra/k8s/vllm.yaml",
            "replicas: 2",
            "replicas: 1",
            "rollout.urls ['http://vllm-0.sao-engines:8000', 'http://vllm-1.sao-engines:8000'] are not the servers",
        ),
        (
            "infra/k8s/vllm.yaml",
            "serviceName: sao-engines",
            "serviceName: engines",
            "StatefulSet.spec.serviceName 'engines' is not the Service 'sao-engines'",
        ),
        ("infra/k8s/vllm.yaml", "clusterIP: None", "clusterIP: 10.0.0.1", "must be headless"),
        (
            "infra/k8s/vllm.yaml",
            '"32768"',
            '"16384"',
            "--max-model-len 16384 is below components/presets/qwen3-30b-a3b.toml's rollout.max_total_tokens 32768",
        ),
        (
            "infra/k8s/vllm.yaml",
            '"/models/Qwen3-30B-A3B-Thinking-2507"',
            '"/models/Qwen3-30B-A3B"',
            "--model /models/Qwen3-30B-A3B is not components/presets/qwen3-30b-a3b.toml's model.path "
            "/models/Qwen3-30B-A3B-Thinking-2507",
        ),
        (
            "infra/k8s/vllm.yaml",
            '"--max-model-len", "32768"]',
            '"--max-model-len", "32768", "--hf-overrides", \'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}\']',
            "--hf-overrides changes the served model's config, but the trainer loads the model directory's config.json",
        ),
        (
            "infra/k8s/vllm.yaml",
            "{name: models, mountPath: /models, readOnly: true}",
            "{name: models, mountPath: /models}",
            "no read-only volume mount holds --model /models/Qwen3-30B-A3B-Thinking-2507",
        ),
        (
            "infra/k8s/vllm.yaml",
            "{name: shared, mountPath: /shared/sao, readOnly: true}",
            "{name: shared, mountPath: /mnt/shared, readOnly: true}",
            "no read-only volume mount holds",
        ),
        (
            "infra/prefect.yaml",
            '"http://vllm-1.sao-engines:8000"]',
            '"http://vllm-2.sao-engines:8000"]',
            "infra/prefect.yaml: deployment gpu-docker (flows/train.py:train): rollout.urls",
        ),
        (
            "infra/work-pools.yaml",
            "- {name: shared, mountPath: /shared/sao}",
            "",
            "sao-gpu-k8s jobs do not mount /shared/sao",
        ),
    ],
)
def test_each_check_bites(tree, file, old, new, message):
    edit_once(tree / file, old, new)
    problems = check_k8s(tree)
    assert any(message in p for p in problems), problems


def test_a_missing_manifest_is_a_problem(tree):
    (tree / "infra" / "k8s" / "vllm.yaml").unlink()
    assert check_k8s(tree) == ["infra/k8s/vllm.yaml: missing (the kubernetes GPU pool's rollout servers)"]


# ---- who may drive the servers ---------------------------------------------------------------------------------

KEY_ENV = """          env:
            # vLLM's API key (read when no --api-key is given; not a flag, so it shows in no process list).
            - name: VLLM_API_KEY
              valueFrom:
                secretKeyRef: {name: sao-engine-auth, key: SAO_API_KEY}
"""
ARGS = '"--max-model-len", "32768"]'
TRAINER_PEER = "matchLabels: {prefect.io/work-pool-name: sao-gpu-k8s}"
PROMETHEUS_PEER = "matchLabels: {app.kubernetes.io/name: prometheus}"
RANGE = "{protocol: TCP, port: 32768, endPort: 60999}"


def _without_policy(path: Path) -> None:
    text = path.read_text()
    path.write_text(text[: text.index("---\n# Only the trainer reaches the servers")])


@pytest.mark.parametrize(
    "old,new,message",
    [
        (KEY_ENV, "", "the vLLM server has no --api-key (nor VLLM_API_KEY): anyone who reaches it may sample"),
        (
            "valueFrom:\n                secretKeyRef: {name: sao-engine-auth, key: SAO_API_KEY}",
            "value: s3cret",
            "VLLM_API_KEY does not come from a Secret (env VLLM_API_KEY: valueFrom.secretKeyRef)",
        ),
        (
            "key: SAO_API_KEY}",
            "key: SAO_API_KEY, optional: true}",
            "VLLM_API_KEY: secretKeyRef sao-engine-auth/SAO_API_KEY is optional: without the Secret vLLM starts with no key",
        ),
        (ARGS, '"--max-model-len", "32768", "--api-key", "hunter2"]', "--api-key is written in the manifest"),
        (
            ARGS,
            '"--max-model-len", "32768", "--api-key=$(API_KEY)"]',
            "--api-key $(API_KEY) does not come from a Secret",
        ),
        (
            TRAINER_PEER,
            "matchLabels: {prefect.io/work-pool-name: sao-gpu-docker}",
            "no NetworkPolicy admits the sao-gpu-k8s jobs' pods (prefect.io/work-pool-name: sao-gpu-k8s) to port 8000",
        ),
        ("{protocol: TCP, port: 8000}", "{protocol: TCP, port: 9000}", "no NetworkPolicy admits the sao-gpu-k8s jobs"),
        (PROMETHEUS_PEER, "matchLabels: {}", "ingress rule 0 admits every pod of the namespace"),
        (
            "        - podSelector:\n            " + PROMETHEUS_PEER,
            "        - ipBlock: {cidr: 0.0.0.0/0}",
            "NetworkPolicy sao-engines-ingress: ingress rule 0 admits addresses (0.0.0.0/0), not labelled pods",
        ),
        (
            "        - podSelector:\n            " + PROMETHEUS_PEER,
            "        - namespaceSelector: {}\n          podSelector:\n            " + PROMETHEUS_PEER,
            "ingress rule 0 admits matching pods of every namespace (an empty namespaceSelector)",
        ),
        ("  namespace: sao\nspec:\n  podSelector", "  namespace: other\nspec:\n  podSelector", "no NetworkPolicy"),
        ("matchLabels: {app: sao-vllm}\n  policyTypes", "matchLabels: {app: vllm}\n  policyTypes", "no NetworkPolicy"),
        ("policyTypes: [Ingress]", "policyTypes: [Egress]", "no NetworkPolicy restricts ingress"),
        (
            "clusterIP: None",
            "type: LoadBalancer",
            "Service sao-engines is a LoadBalancer: it exposes routes vLLM's --api-key does not guard",
        ),
    ],
)
def test_each_access_check_bites(tree, old, new, message):
    edit_once(tree / "infra" / "k8s" / "vllm.yaml", old, new)
    problems = check_k8s(tree)
    assert any(message in p for p in problems), problems
    assert all(p.startswith("infra/k8s/vllm.yaml: ") for p in problems), problems


def test_servers_without_a_network_policy_are_refused(tree):
    _without_policy(tree / "infra" / "k8s" / "vllm.yaml")
    assert check_k8s(tree) == [
        "infra/k8s/vllm.yaml: no NetworkPolicy restricts ingress to the vLLM servers, and vLLM's --api-key guards only "
        "/v1, /v2, /inference, /cohere, not /invocations (the same sampling as /v1) and, with VLLM_SERVER_DEV_MODE=1, "
        "/collective_rpc (loads weights from any path the server reads), /reset_prefix_cache, /sleep, /pause and the "
        "other dev routes: add one that admits only the sao-gpu-k8s jobs' pods (prefect.io/work-pool-name: "
        "sao-gpu-k8s)"
    ]


def test_a_key_passed_as_a_flag_from_a_secret_passes(tree):
    manifest = tree / "infra" / "k8s" / "vllm.yaml"
    edit_once(manifest, ARGS, '"--max-model-len", "32768", "--api-key", "$(ENGINE_KEY)"]')
    edit_once(manifest, "- name: VLLM_API_KEY", "- name: ENGINE_KEY")
    assert check_k8s(tree) == []


def test_a_label_of_the_pools_own_pod_template_admits_the_trainer(tree):
    spec = "            spec:\n              subdomain: sao-train"
    pod, labelled = (
        f"          template:\n{spec}",
        f"          template:\n            metadata: {{labels: {{app: sao-trainer}}}}\n{spec}",
    )
    edit_once(tree / "infra" / "k8s" / "vllm.yaml", TRAINER_PEER, "matchLabels: {app: sao-trainer}")
    assert any("no NetworkPolicy admits the sao-gpu-k8s jobs' pods" in p for p in check_k8s(tree))
    edit_once(tree / "infra" / "work-pools.yaml", pod, labelled)
    assert check_k8s(tree) == []


def test_a_rule_without_from_admits_everyone(tree):
    manifest = tree / "infra" / "k8s" / "vllm.yaml"
    text = manifest.read_text()
    manifest.write_text(text[: text.index("    - from:")] + f"    - ports: [{{protocol: TCP, port: 8000}}, {RANGE}]\n")
    assert check_k8s(tree) == [
        "infra/k8s/vllm.yaml: NetworkPolicy sao-engines-ingress: ingress rule 0 admits every source (no `from`): only "
        "the trainer's pods may reach the servers"
    ]


# ---- the weight transfer's group (issue 42, item 5) --------------------------------------------------------------
# The manifests before issue 42 item 5: a policy admitting only TCP 8000, no NCCL settings on either side, no /models
# in the training job. Each check fails on that form and passes on the tree (test_the_real_tree_is_consistent).

TRANSFER_RULE = """    - from:
        - podSelector:
            matchLabels: {prefect.io/work-pool-name: sao-gpu-k8s}   # the trainer's rank 0
      ports:
        - {protocol: TCP, port: 32768, endPort: 60999}              # endPort: Kubernetes 1.25 or later
"""
SERVER_NCCL = (
    "          envFrom:\n            - configMapRef: {name: sao-nccl}   # the transfer group's NCCL settings, the same "
    "as the trainer's\n"
)
JOB_NCCL = "                    - configMapRef: {name: sao-nccl, optional: false}\n"
JOB_MODELS = "                    - {name: models, mountPath: /models, readOnly: true}"
COLLECTIVE = (
    'components/presets/qwen3-30b-a3b.toml\'s rollout.weight_transfer = "collective" would hang forming its group'
)
ONLY_HTTP = (
    "infra/k8s/vllm.yaml: NetworkPolicy sao-engines-ingress: spec.ingress admits pods {'prefect.io/work-pool-name': "
    "'sao-gpu-k8s'} to pods {'app': 'sao-vllm'} on TCP 8000 only, not on 32768-60999, the servers' ephemeral ports "
    "(net.ipv4.ip_local_port_range), where the trainer's rank 0 (NCCL's bootstrap root) connects back to each server"
)
NOT_SET = "NCCL_{} is not set"
SERVER = "infra/k8s/vllm.yaml: StatefulSet vllm: container vllm: "
JOB = "infra/work-pools.yaml: sao-gpu-k8s: job_manifest: container: "
NO_MODELS = (
    "infra/work-pools.yaml: sao-gpu-k8s: job_manifest: no read-only volume mount holds "
    "components/presets/qwen3-30b-a3b.toml's model.path /models/Qwen3-30B-A3B-Thinking-2507, which the training and "
    "evaluation jobs load: mount the servers' claim sao-models at /models, read-only"
)


def _old_form(tree: Path) -> None:
    edit_once(tree / "infra" / "k8s" / "vllm.yaml", TRANSFER_RULE, "")
    edit_once(tree / "infra" / "k8s" / "vllm.yaml", SERVER_NCCL, "")
    edit_once(tree / "infra" / "work-pools.yaml", JOB_NCCL, "")
    edit_once(tree / "infra" / "work-pools.yaml", JOB_MODELS, "")


def test_the_manifests_before_the_fix_are_refused(tree):
    _old_form(tree)
    problems = check_k8s(tree)
    expected = [ONLY_HTTP, NO_MODELS] + [
        side + NOT_SET.format(name) for side in (SERVER, JOB) for name in ("SOCKET_IFNAME", "IB_DISABLE", "DEBUG")
    ]
    for message in expected:
        assert any(p.startswith(message) for p in problems), (message, problems)
    assert all(COLLECTIVE in p for p in problems if p.startswith(ONLY_HTTP)), problems


@pytest.mark.parametrize(
    "old,new,message",
    [
        (TRANSFER_RULE, "", ONLY_HTTP),
        # a range one port short of the servers' sysctl (60999)
        (
            "port: 32768, endPort: 60999}",
            "port: 32768, endPort: 60998}",
            "on TCP 8000, 32768-60998 only, not on 32768-60999",
        ),
        # a sysctl wider than the policy's range: the kernel would bind NCCL's listeners outside what is admitted
        ('value: "32768 60999"}', 'value: "1024 65535"}', "on TCP 8000, 32768-60999 only, not on 1024-65535"),
        ('value: "32768 60999"}', 'value: "60999"}', "net.ipv4.ip_local_port_range '60999': not LOW HIGH"),
        # rule 1 admitting UDP only: NCCL's sockets are TCP
        ("{protocol: TCP, port: 32768, endPort", "{protocol: UDP, port: 32768, endPort", "on TCP 8000 only"),
        # rule 1 admitting Prometheus instead of the trainer
        (
            "matchLabels: {prefect.io/work-pool-name: sao-gpu-k8s}   # the trainer's rank 0",
            "matchLabels: {app.kubernetes.io/name: prometheus}",
            ONLY_HTTP,
        ),
    ],
)
def test_each_transfer_port_check_bites(tree, old, new, message):
    edit_once(tree / "infra" / "k8s" / "vllm.yaml", old, new)
    problems = check_k8s(tree)
    assert any(message in p for p in problems), problems


def test_only_the_http_port_passes_when_no_preset_uses_the_collective_transfer(tree):
    edit_once(tree / "infra" / "k8s" / "vllm.yaml", TRANSFER_RULE, "")
    assert any(p.startswith(ONLY_HTTP) for p in check_k8s(tree))
    for preset in ("qwen3-30b-a3b", "qwen3-30b-a3b-coding"):
        edit_once(tree / "components" / "presets" / f"{preset}.toml", '"collective"', '"filesystem"')
    assert check_k8s(tree) == []


EGRESS = """---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: sao-engines-egress, namespace: sao}
spec:
  podSelector:
    matchLabels: {app: sao-vllm}
  policyTypes: [Egress]
  egress:
    - to:
        - podSelector:
            matchLabels: {prefect.io/work-pool-name: sao-gpu-k8s}
      ports: [{protocol: TCP, port: 32768, endPort: 60999}]
"""
TRAINER_INGRESS = """---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: sao-trainer-ingress, namespace: sao}
spec:
  podSelector:
    matchLabels: {prefect.io/work-pool-name: sao-gpu-k8s}
  ingress:
    - from:
        - podSelector:
            matchLabels: {app: sao-vllm}
      ports: [{protocol: TCP, port: 32768, endPort: 60999}]
"""
BACK = "not on 32768-60999, the trainer's ephemeral ports (net.ipv4.ip_local_port_range), where each server reaches"


@pytest.mark.parametrize(
    "policy,name,kind", [(EGRESS, "sao-engines-egress", "egress"), (TRAINER_INGRESS, "sao-trainer-ingress", "ingress")]
)
def test_a_policy_on_the_way_back_must_admit_the_trainers_ports(tree, policy, name, kind):
    manifest = tree / "infra" / "k8s" / "vllm.yaml"
    manifest.write_text(manifest.read_text() + policy)
    assert check_k8s(tree) == []  # servers -> trainer on the trainer's range: the store and NCCL's other direction
    edit_once(manifest, policy, policy.replace("port: 32768, endPort: 60999", "port: 29500"))
    assert check_k8s(tree) == [
        f"infra/k8s/vllm.yaml: NetworkPolicy {name}: spec.{kind} admits pods {{'app': 'sao-vllm'}} to pods "
        f"{{'prefect.io/work-pool-name': 'sao-gpu-k8s'}} on TCP 29500 only, {BACK} its rendezvous store "
        f"(rollout.transfer_address, a port chosen free) and NCCL connects the other way: {COLLECTIVE}"
    ]


@pytest.mark.parametrize(
    "file,old,new,message",
    [
        ("infra/work-pools.yaml", JOB_NCCL, "", JOB + NOT_SET.format("SOCKET_IFNAME")),
        (
            "infra/k8s/vllm.yaml",
            SERVER_NCCL,
            "",
            SERVER + NOT_SET.format("DEBUG"),
        ),
        (
            "infra/work-pools.yaml",
            "configMapRef: {name: sao-nccl, optional: false}",
            "configMapRef: {name: nccl, optional: false}",
            JOB + "envFrom configMapRef nccl: no such ConfigMap in infra/k8s/vllm.yaml",
        ),
        # the old transport choice left implicit: the ConfigMap without NCCL_IB_DISABLE
        ("infra/k8s/vllm.yaml", '  NCCL_IB_DISABLE: "1"\n', "", SERVER + NOT_SET.format("IB_DISABLE")),
        (
            "infra/k8s/vllm.yaml",
            "  NCCL_DEBUG: WARN",
            "  NCCL_DEBUG: NONE",
            SERVER + "NCCL_DEBUG='NONE' logs no `NCCL version` line",
        ),
        # the trainer's own `env` beats the ConfigMap (envFrom) and disagrees with the servers
        (
            "infra/work-pools.yaml",
            JOB_NCCL,
            JOB_NCCL + "                  env:\n                    - {name: NCCL_SOCKET_IFNAME, value: ib0}\n",
            JOB + "NCCL_SOCKET_IFNAME='ib0', but the vLLM servers (infra/k8s/vllm.yaml) have 'eth0'",
        ),
        # a setting on one side only
        (
            "infra/k8s/vllm.yaml",
            "            - name: VLLM_API_KEY",
            "            - {name: NCCL_IB_HCA, value: mlx5_0}\n            - name: VLLM_API_KEY",
            JOB + "NCCL_IB_HCA=None, but the vLLM servers (infra/k8s/vllm.yaml) have 'mlx5_0'",
        ),
        # a deployment's job variables override the pool's ConfigMap in the trainer's pods
        (
            "infra/prefect.yaml",
            "SAO_PROMETHEUS_ADDR: 0.0.0.0\n    gpu_k8s_eval",
            "SAO_PROMETHEUS_ADDR: 0.0.0.0\n          NCCL_DEBUG: INFO\n    gpu_k8s_eval",
            "infra/prefect.yaml: deployment gpu-k8s (flows/train.py:train): job_variables.env: NCCL_DEBUG='INFO', but "
            "the vLLM servers (infra/k8s/vllm.yaml) have 'WARN'",
        ),
    ],
)
def test_each_nccl_check_bites(tree, file, old, new, message):
    edit_once(tree / file, old, new)
    problems = check_k8s(tree)
    assert any(p.startswith(message) for p in problems), problems


@pytest.mark.parametrize(
    "old,new,message",
    [
        (JOB_MODELS, "", NO_MODELS),
        (JOB_MODELS, "                    - {name: models, mountPath: /models}", NO_MODELS),
        (
            "default: sao-models",
            "default: sao-weights",
            "infra/work-pools.yaml: sao-gpu-k8s: job_manifest: components/presets/qwen3-30b-a3b.toml's model.path "
            "/models/Qwen3-30B-A3B-Thinking-2507 is on claim sao-weights at /models (volumes, variables), the vLLM "
            "servers read it from claim sao-models at /models",
        ),
    ],
)
def test_each_models_check_bites(tree, old, new, message):
    edit_once(tree / "infra" / "work-pools.yaml", old, new)
    problems = check_k8s(tree)
    assert any(p.startswith(message) for p in problems), problems
