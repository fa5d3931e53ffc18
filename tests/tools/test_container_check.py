"""The containers that run model-written code keep what the sandbox needs (tools/container_check.py): the real tree
passes, and each deliberately broken copy is named, file and setting."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.factories import edit_once
from tools.container_check import check_containers

ROOT = Path(__file__).resolve().parents[2]
POOLS, COMPOSE = "infra/work-pools.yaml", "infra/compose.yaml"
GPU_PRESET = "components/presets/qwen3-30b-a3b.toml"


def test_the_real_tree_keeps_the_sandbox_whole():
    assert check_containers(ROOT) == []


@pytest.fixture
def tree(tmp_path):
    shutil.copytree(ROOT / "infra", tmp_path / "infra")
    shutil.copytree(ROOT / "components" / "presets", tmp_path / "components" / "presets")
    return tmp_path


@pytest.mark.parametrize(
    "file,old,new,message",
    [
        # The first SYS_ADMIN line of the pools file is the docker pool's.
        (
            POOLS,
            "          - SYS_ADMIN ",
            "          - NET_ADMIN ",
            "infra/work-pools.yaml: sao-gpu-docker: container_create_kwargs: cap_add lacks SYS_ADMIN",
        ),
        (
            POOLS,
            '        user: "0" ',
            '        user: "10001" ',
            "infra/work-pools.yaml: sao-gpu-docker: container_create_kwargs: user is '10001', not root",
        ),
        (
            POOLS,
            "          - seccomp=unconfined",
            "          - no-new-privileges:true",
            "sao-gpu-docker: container_create_kwargs: security_opt lacks seccomp=unconfined",
        ),
        (
            POOLS,
            "          - apparmor=unconfined",
            "          - apparmor=docker-default",
            "sao-gpu-docker: container_create_kwargs: security_opt lacks apparmor=unconfined",
        ),
        (
            POOLS,
            "        cap_drop: [ALL]",
            "        cap_drop: [NET_RAW]",
            "sao-gpu-docker: container_create_kwargs: cap_drop",
        ),
        (
            POOLS,
            "runAsUser: 0 ",
            "runAsUser: 10001 ",
            "infra/work-pools.yaml: sao-gpu-k8s: job_manifest: securityContext.runAsUser is 10001, not 0",
        ),
        (
            POOLS,
            "                        - SETUID ",
            "                        - SETPCAP ",
            "sao-gpu-k8s: job_manifest: securityContext.capabilities.add lacks SETUID",
        ),
        (
            POOLS,
            "type: Unconfined   # RuntimeDefault",
            "type: RuntimeDefault   #",
            "sao-gpu-k8s: job_manifest: securityContext.seccompProfile.type must be Unconfined",
        ),
        (
            POOLS,
            "                    runAsNonRoot: false\n",
            "                    runAsNonRoot: false\n                    privileged: true\n",
            "sao-gpu-k8s: job_manifest: securityContext.privileged",
        ),
        (COMPOSE, '    user: "0"\n', "", "infra/compose.yaml: service 'worker': user is None, not root"),
        (
            COMPOSE,
            "      - KILL ",
            "      - NET_RAW ",
            "infra/compose.yaml: service 'worker': cap_add lacks KILL",
        ),
        (
            GPU_PRESET,
            'sandbox_degraded = "refuse"',
            'sandbox_degraded = "warn"',
            "components/presets/qwen3-30b-a3b.toml: rollout.sandbox_degraded is 'warn'",
        ),
    ],
)
def test_each_check_bites(tree, file, old, new, message):
    edit_once(tree / file, old, new)
    problems = check_containers(tree)
    assert any(message in p for p in problems), problems
