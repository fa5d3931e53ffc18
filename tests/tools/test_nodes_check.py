"""Training across nodes on the kubernetes pool (tools/nodes_check.py): the indexed Job, the headless Service its pods
resolve through and the deployments' launch commands agree; each check fails on a deliberately broken copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.factories import edit_once
from tools.nodes_check import check_nodes

ROOT = Path(__file__).resolve().parents[2]


def test_the_real_tree_is_consistent():
    assert check_nodes(ROOT) == []


@pytest.fixture
def tree(tmp_path):
    shutil.copytree(ROOT / "infra", tmp_path / "infra")
    return tmp_path


@pytest.mark.parametrize(
    "file,old,new,message",
    [
        ("infra/work-pools.yaml", "completionMode: Indexed", "completionMode: NonIndexed", "not 'Indexed'"),
        (
            "infra/work-pools.yaml",
            'completions: "{{ nodes }}"',
            "completions: 1",
            "job_manifest.spec.completions is 1, not '{{ nodes }}'",
        ),
        ("infra/work-pools.yaml", "subdomain: sao-train", "subdomain: sao-trainers", "'sao-trainers' is no Service"),
        ("infra/work-pools.yaml", "      nodes:\n", "      node_count:\n", "no job variable `nodes`"),
        ("infra/k8s/train.yaml", "clusterIP: None", "clusterIP: 10.0.0.2", "must be headless"),
        ("infra/k8s/train.yaml", "publishNotReadyAddresses: true", "publishNotReadyAddresses: false", "only once"),
        (
            "infra/k8s/train.yaml",
            "prefect.io/work-pool-name: sao-gpu-k8s",
            "prefect.io/work-pool-name: sao-gpu-docker",
            "does not select the jobs' pods",
        ),
        (
            "infra/prefect.yaml",
            '"python -m flows.launch --nnodes 4 --nproc-per-node 8"',
            '"python -m flows.launch --nnodes 2 --nproc-per-node 8"',
            "deployment gpu-k8s-4nodes (flows/train.py:train): --nnodes 2 is not its job's 4 node(s)",
        ),
        (
            "infra/prefect.yaml",
            '"python -m flows.launch --nnodes 4 --nproc-per-node 8"',
            '"python -m flows.launch --nnodes 4 --nproc-per-node 4"',
            "--nproc-per-node 4 is not its 8 GPUs per node",
        ),
        (
            "infra/prefect.yaml",
            'command: "python -m flows.launch --nproc-per-node 8"',
            'command: "python -m flows.launch --nnodes 2 --nproc-per-node 8"',
            "deployment gpu-docker (flows/train.py:train): --nnodes 2 is not its job's 1 node(s) (the sao-gpu-docker "
            "pool runs one container on one host)",
        ),
        (
            "infra/prefect.yaml",
            'command: "python -m flows.launch --nproc-per-node 8"',
            'command: "torchrun --standalone --nproc-per-node=8 -m flows.ranks"',
            "is not `python -m flows.launch ...`",
        ),
    ],
)
def test_each_check_bites(tree, file, old, new, message):
    edit_once(tree / file, old, new)
    problems = check_nodes(tree)
    assert any(message in p for p in problems), problems


def test_a_policy_on_the_jobs_pods_must_admit_the_rendezvous_and_the_worlds_ports(tree):
    policy = """---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: trainers, namespace: sao}
spec:
  podSelector:
    matchLabels: {prefect.io/work-pool-name: sao-gpu-k8s}
  policyTypes: [Ingress]
  ingress:
    - from:
        - podSelector:
            matchLabels: {prefect.io/work-pool-name: sao-gpu-k8s}
      ports:
        - {protocol: TCP, port: 29400}
"""
    (tree / "infra" / "k8s" / "train.yaml").write_text((tree / "infra" / "k8s" / "train.yaml").read_text() + policy)
    problems = check_nodes(tree)
    assert problems == [
        "infra/k8s: NetworkPolicy trainers: spec.ingress admits pods {'prefect.io/work-pool-name': 'sao-gpu-k8s'} to "
        "pods {'prefect.io/work-pool-name': 'sao-gpu-k8s'} on TCP 29400 only, not on 32768-60999 (the world's store, "
        "gloo and NCCL): the nodes of a job could not form their world"
    ]
    edit_once(
        tree / "infra" / "k8s" / "train.yaml",
        "{protocol: TCP, port: 29400}",
        "{protocol: TCP, port: 29400}\n        - {protocol: TCP, port: 32768, endPort: 60999}",
    )
    assert check_nodes(tree) == []
