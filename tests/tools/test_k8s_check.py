"""The kubernetes rollout servers (infra/k8s/vllm.yaml) stay in step with the GPU presets, the GPU deployments and
the k8s work pool; each check fails on a deliberately broken copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tools.k8s_check import check_k8s

ROOT = Path(__file__).resolve().parents[2]


def test_the_real_tree_is_consistent():
    assert check_k8s(ROOT) == []


@pytest.fixture
def tree(tmp_path):
    shutil.copytree(ROOT / "infra", tmp_path / "infra")
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


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
    _edit(tree / file, old, new)
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
    _edit(tree / "infra" / "k8s" / "vllm.yaml", old, new)
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
    _edit(manifest, ARGS, '"--max-model-len", "32768", "--api-key", "$(ENGINE_KEY)"]')
    _edit(manifest, "- name: VLLM_API_KEY", "- name: ENGINE_KEY")
    assert check_k8s(tree) == []


def test_a_label_of_the_pools_own_pod_template_admits_the_trainer(tree):
    spec = "            spec:\n              containers:"
    pod, labelled = (
        f"          template:\n{spec}",
        f"          template:\n            metadata: {{labels: {{app: sao-trainer}}}}\n{spec}",
    )
    _edit(tree / "infra" / "k8s" / "vllm.yaml", TRAINER_PEER, "matchLabels: {app: sao-trainer}")
    assert any("no NetworkPolicy admits the sao-gpu-k8s jobs' pods" in p for p in check_k8s(tree))
    _edit(tree / "infra" / "work-pools.yaml", pod, labelled)
    assert check_k8s(tree) == []


def test_a_rule_without_from_admits_everyone(tree):
    manifest = tree / "infra" / "k8s" / "vllm.yaml"
    text = manifest.read_text()
    manifest.write_text(text[: text.index("    - from:")] + "    - ports: [{protocol: TCP, port: 8000}]\n")
    assert check_k8s(tree) == [
        "infra/k8s/vllm.yaml: NetworkPolicy sao-engines-ingress: ingress rule 0 admits every source (no `from`): only "
        "the trainer's pods may reach the servers"
    ]
