"""Beyond one node (flows/launch.py, components/stages/nodes.py): the launcher's torchrun command for one node and for
several, and `sao train` under it as two nodes on loopback (two torchrun agents, a c10d rendezvous) against one node
with two ranks: the same weights after 3 synchronous steps; two nodes that do not share the run home are refused."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.models import load_policy
from flows.launch import LaunchError, indexed_job_endpoint, torchrun_args
from tests.cli_args import SMALL_TRAIN, sets
from tests.conftest import free_port

TARGET = ["-m", "flows.ranks"]


def test_one_node_is_standalone():
    assert torchrun_args(1, "8", None, None, None, TARGET) == ["--standalone", "--nproc-per-node", "8", *TARGET]


def test_several_nodes_form_a_c10d_rendezvous_hosted_by_node_zero():
    args = torchrun_args(4, "8", 0, "node-a:29400", "run-1", TARGET)
    assert args == [
        "--nnodes",
        "4",
        "--nproc-per-node",
        "8",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node-a:29400",
        "--rdzv-id",
        "run-1",
        "--rdzv-conf",
        "is_host=true",
        *TARGET,
    ]
    assert torchrun_args(4, "8", 3, "node-a:29400", "run-1", TARGET)[-3] == "is_host=false"


def test_an_indexed_jobs_pod_finds_node_zero_by_its_own_name():
    fqdn = "train-gpu-k8s-4nodes-x7k2p-3.sao-train.sao.svc.cluster.local"
    assert indexed_job_endpoint(fqdn, 3) == "train-gpu-k8s-4nodes-x7k2p-0.sao-train.sao.svc.cluster.local:29400"
    args = torchrun_args(4, "gpu", 3, None, "run-1", TARGET, fqdn=fqdn)
    assert (
        args[args.index("--rdzv-endpoint") + 1] == "train-gpu-k8s-4nodes-x7k2p-0.sao-train.sao.svc.cluster.local:29400"
    )
    with pytest.raises(LaunchError, match="subdomain"):
        indexed_job_endpoint("train-x7k2p-3", 3)  # no subdomain: other pods cannot resolve it
    with pytest.raises(LaunchError, match="not an indexed Job's pod"):
        indexed_job_endpoint("worker.example", 3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ((0, "8", None, None, None), r"--nnodes: must be >= 1, got 0"),
        ((2, "eight", 0, "a:1", "r"), r"--nproc-per-node: a count >= 1 or 'gpu', got 'eight'"),
        ((2, "8", None, "a:1", "r"), r"--node-index: required"),
        ((2, "8", 2, "a:1", "r"), r"--node-index: 2 is not a node of 2 \(0 .. 1\)"),
        ((2, "8", 1, "a:1", None), r"--rdzv-id: required"),
        ((2, "8", 1, "a", "r"), r"--rdzv-endpoint: expected HOST:PORT, got 'a'"),
    ],
)
def test_a_launch_that_cannot_form_its_world_is_refused_naming_the_option(call, message):
    with pytest.raises(LaunchError, match=message):
        torchrun_args(*call, TARGET)


def test_the_launcher_command_refuses_with_one_line(monkeypatch):
    for name in ("SAO_NODE_INDEX", "JOB_COMPLETION_INDEX", "SAO_RDZV_ID", "PREFECT__FLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    done = subprocess.run(
        [sys.executable, "-m", "flows.launch", "--nnodes", "2", "--nproc-per-node", "1"], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "sao: launch: --node-index: required with --nnodes > 1 ($SAO_NODE_INDEX, or an indexed Job's)"
    ]


TRAIN = {
    **SMALL_TRAIN,
    "train.sync": "true",
    "train.max_steps": 3,
    "tracking.backend": '"disk"',
    "value_pretrain.warm_start": "false",
    "rollout.concurrency": 1,
    "rollout.max_batch": 1,
}
"""3 synchronous steps from a fresh critic, one sequence at a time: the engine's logits do not depend on what else
is in its batch, so both launches sample the same rollouts."""


def _train(home: Path, launch: list[str]) -> list[str]:
    """The launcher's command line that runs `sao train` on `home`."""
    return [sys.executable, "-m", "flows.launch", *launch, "-m", "components.cli", "train", "--home", str(home)]


def _nodes(homes: list[Path], env: dict) -> list[subprocess.CompletedProcess]:
    """Two nodes of one rank each, on loopback: node i trains on homes[i]."""
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    nodes = [
        subprocess.Popen(
            _train(home, [*rendezvous, "--node-index", str(i), "--rdzv-id", "two-nodes"]) + sets(TRAIN),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i, home in enumerate(homes)
    ]
    outs = [node.communicate(timeout=600) for node in nodes]
    return [subprocess.CompletedProcess(n.args, n.returncode, o, e) for n, (o, e) in zip(nodes, outs)]


def _weights(policy: Path) -> torch.Tensor:
    state = load_policy(policy).state_dict()
    return torch.cat([v.flatten().float() for _, v in sorted(state.items())])


@pytest.mark.ranks
def test_two_nodes_train_what_one_node_with_two_ranks_trains(seeded_home, prefect_env, tmp_path):
    """`python -m flows.launch` as two nodes of one rank (c10d rendezvous on loopback, one shared home) and as one
    node of two ranks, each 3 synchronous steps of `sao train` on copies of one seeded home: the same policy (fp32,
    1e-4). Two nodes whose homes differ (each its own disk) are refused before any step, on every node."""
    env = {**prefect_env, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    single, pristine = tmp_path / "one-node", tmp_path / "pristine"
    shutil.copytree(seeded_home, single)
    shutil.copytree(seeded_home, pristine)
    done = subprocess.run(
        _train(single, ["--nproc-per-node", "2"]) + sets(TRAIN), capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]

    two = _nodes([seeded_home, seeded_home], env)
    assert [n.returncode for n in two] == [0, 0], two[0].stderr[-3000:] + two[1].stderr[-3000:]
    assert "2 process(es)" in two[0].stdout + two[0].stderr + two[1].stdout + two[1].stderr  # one world of two
    a, b = (_weights(home / "models" / "tiny-cpu-sao-policy") for home in (single, seeded_home))
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    moved = (a - _weights(seeded_home / "models" / "sft-tir_math")).abs().max()
    assert moved > 3e-4 and (a - b).abs().max() < moved / 10, (moved, (a - b).abs().max())  # 3 steps moved it

    apart = [tmp_path / "node-0", tmp_path / "node-1"]
    for home in apart:
        shutil.copytree(pristine, home)
    refused = _nodes(apart, env)
    for node in refused:
        assert node.returncode != 0
        assert "cannot see what rank 0" in node.stderr and "one shared volume" in node.stderr, node.stderr[-3000:]
