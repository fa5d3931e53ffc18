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
