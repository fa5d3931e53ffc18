"""Deployments for real: a local `prefect server start`, `make deploy` against it, `make worker` (a process worker in
this checkout), then deployments run through the worker and are checked through the API: the `train/local`
deployment, the `evaluate/on-checkpoint-local` run its `sao.checkpoint.saved` event triggers, and `train/local` with
the GPU pools' command (`python -m flows.launch ...`: torchrun, `-m flows.ranks`) on two CPU ranks, as one node and as
two nodes. Marked `server` (make test-ops)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import child_env, free_port

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "sft.steps=20",
    "sft.batch_size=16",
    "sft.warmup_steps=2",
    "task.train_size=200",
    "task.eval_size=4",
    "train.max_steps=2",
    "train.batch_size=4",
    "rollout.concurrency=4",
    "train.checkpoint_every=2",
    'tracking.backend="disk"',
]
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(proc: subprocess.Popen) -> None:
    with_group = os.getpgid(proc.pid)
    os.killpg(with_group, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(with_group, signal.SIGKILL)
        proc.wait()


def _make(target: str, env: dict) -> subprocess.CompletedProcess:
    # -o: the test runs inside the installed venv; never reinstall it from here
    return subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """(API URL, run home, log dir): a server with every deployment registered and a process worker polling."""
    logs = tmp_path_factory.mktemp("logs")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = child_env(
        PREFECT_HOME=str(tmp_path_factory.mktemp("prefect-home")),
        PREFECT_API_URL=api,
        PREFECT_SERVER_PORT=str(port),
        SAO_HOME=str(tmp_path_factory.mktemp("sao-home")),
    )
    server = _start(
        [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        logs / "server.log",
    )
    worker = None
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, (logs / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Prefect server did not answer /api/health in 180 s"
            time.sleep(1)
        done = _make("deploy", env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "work pools: sao-process, sao-gpu-docker, sao-gpu-k8s" in done.stdout
        worker = _start(["make", "-s", "-o", ".venv/.installed", "worker"], env, logs / "worker.log")
        yield api, Path(env["SAO_HOME"]), logs
    finally:
        if worker is not None:
            _stop(worker)
        _stop(server)


def _api(api: str):
    """This process talks to the test's server (not to an ephemeral one) inside the block."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings({PREFECT_API_URL: api})


def _client(api: str):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(api)


def _wait(client, flow_run_id, timeout_s: float, logs: Path):
    deadline = time.monotonic() + timeout_s
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state and run.state.type.value in FINAL:
            return run
        assert time.monotonic() < deadline, (
            f"flow run {run.name} still {run.state.type.value} after "
            f"{timeout_s} s\n" + (logs / "worker.log").read_text()[-4000:]
        )
        time.sleep(2)


def _artifact_keys(client, flow_run_id) -> set[str]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    found = client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    )
    return {a.key for a in found}


def test_make_deploy_registers_every_flow_with_pools_schedules_limits_and_the_trigger(deployed):
    api, _, _ = deployed
    with _client(api) as client:
        deployments = {(client.read_flow(d.flow_id).name, d.name): d for d in client.read_deployments()}
        pools = {p.name: p for p in client.read_work_pools()}
        automations = client.read_automations()
    flows = {"distill", "gate", "sft", "value_pretrain", "train", "evaluate", "style_shift", "experiment", "pipeline"}
    assert {f for f, name in deployments if name == "local"} == flows
    assert {p: pools[p].type for p in pools} == {
        "sao-process": "process",
        "sao-gpu-docker": "docker",
        "sao-gpu-k8s": "kubernetes",
    }
    # GPU pools: concurrency-limited, with the GPU job variables placed in the job
    assert pools["sao-gpu-docker"].concurrency_limit == 2 and pools["sao-gpu-k8s"].concurrency_limit == 4
    docker_job = pools["sao-gpu-docker"].base_job_template["job_configuration"]
    assert docker_job["container_create_kwargs"]["device_requests"][0]["count"] == "{{ gpus }}"
    k8s_container = pools["sao-gpu-k8s"].base_job_template["job_configuration"]["job_manifest"]["spec"]["template"][
        "spec"
    ]["containers"][0]
    assert k8s_container["resources"]["limits"] == {
        "cpu": "{{ cpu_limit }}",
        "memory": "{{ memory_limit }}",
        "nvidia.com/gpu": "{{ gpus }}",
    }
    train_gpu = deployments[("train", "gpu-k8s")]
    assert train_gpu.job_variables["command"].startswith("python -m flows.launch")
    assert train_gpu.job_variables["gpus"] == 8
    # across nodes: an indexed Job of `nodes` pods under the headless Service sao-train (infra/k8s/train.yaml)
    k8s_job = pools["sao-gpu-k8s"].base_job_template["job_configuration"]["job_manifest"]["spec"]
    assert (k8s_job["completionMode"], k8s_job["completions"], k8s_job["template"]["spec"]["subdomain"]) == (
        "Indexed",
        "{{ nodes }}",
        "sao-train",
    )
    four = deployments[("train", "gpu-k8s-4nodes")].job_variables
    assert (four["nodes"], four["command"]) == (4, "python -m flows.launch --nnodes 4 --nproc-per-node 8")
    assert train_gpu.global_concurrency_limit.limit == 1
    # schedules: nightly retraining and periodic evaluation
    assert [s.schedule.cron for s in deployments[("pipeline", "nightly-gpu-k8s")].schedules] == ["0 2 * * *"]
    assert [s.schedule.cron for s in deployments[("evaluate", "periodic-gpu-k8s")].schedules] == ["0 */6 * * *"]
    # the UI's editable defaults come from the flows' typed signatures
    schema = deployments[("train", "local")].parameter_openapi_schema["properties"]
    assert schema["resume"]["type"] == "boolean" and schema["preset"]["default"] == "tiny-cpu"
    trigger = {a.name: a for a in automations}["on-checkpoint-local__automation_1"]
    assert trigger.trigger.expect == {"sao.checkpoint.saved"}


def test_a_train_deployment_runs_on_the_worker_and_its_checkpoint_triggers_an_evaluation(deployed):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.deployments import run_deployment

    api, home, logs = deployed
    with _client(api) as client:
        with _api(api):
            run = run_deployment(
                "train/local",
                parameters={"overrides": TINY + ['train.backend="torch"'], "home": str(home / "one")},
                timeout=0,
            )
        run = _wait(client, run.id, 600, logs)
        assert run.state.type.value == "COMPLETED", (logs / "worker.log").read_text()[-4000:]
        assert "train" in _artifact_keys(client, run.id)
        assert (home / "one" / "checkpoints").exists()
        # each checkpoint event (the initial weights, step 0, and step 2) -> the automation -> an evaluate run of
        # on-checkpoint-local, on the same worker
        trigger = client.read_deployment_by_name("evaluate/on-checkpoint-local")
        deadline = time.monotonic() + 180
        while (
            len(
                evals := client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[trigger.id]))
                )
            )
            < 2
        ):
            assert time.monotonic() < deadline, f"{len(evals)} evaluate run(s) triggered by sao.checkpoint.saved"
            time.sleep(2)
        evaluated = [_wait(client, r.id, 300, logs) for r in evals]
        assert [r.state.type.value for r in evaluated] == ["COMPLETED"] * 2, (logs / "worker.log").read_text()[-4000:]
        assert sorted(int(r.parameters["checkpoint_step"]) for r in evaluated) == [0, 2]
        for r in evaluated:
            assert r.parameters["overrides"] == TINY + ['train.backend="torch"']
            assert r.parameters["home"] == str((home / "one").resolve())
            assert "evaluate" in _artifact_keys(client, r.id)


@pytest.mark.parametrize(
    ("name", "nodes"),
    [
        ("one-node", "{python} -m flows.launch --nproc-per-node 2"),
        # two nodes of one rank on loopback, in one job: node 1 in the background, node 0 in front; the rendezvous id
        # is the flow run's (PREFECT__FLOW_RUN_ID, which both inherit)
        (
            "two-nodes",
            "bash -c '{python} -m flows.launch {two} --node-index 1 & one=$!; "
            "{python} -m flows.launch {two} --node-index 0 && wait $one'",
        ),
    ],
)
def test_the_gpu_pools_command_runs_the_flow_on_rank_0_and_trains_deepspeed_on_two_ranks(deployed, name, nodes):
    """The GPU deployments' command (flows/launch.py: torchrun, one rank per device, `-m flows.ranks`) on two CPU
    ranks, as one node and as two (a c10d rendezvous on loopback)."""
    from prefect.deployments import run_deployment

    api, home, logs = deployed
    two = f"--nnodes 2 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:{free_port()}"
    command = nodes.format(python=sys.executable, two=two)
    with _client(api) as client:
        with _api(api):
            run = run_deployment(
                "train/local",
                parameters={
                    "overrides": TINY + ['train.backend="deepspeed"', "train.zero_stage=1"],
                    "home": str(home / "two" / name),
                    "evaluate": False,
                },
                job_variables={"command": command},
                timeout=0,
            )
        run = _wait(client, run.id, 600, logs)
        assert run.state.type.value == "COMPLETED", (logs / "worker.log").read_text()[-4000:]
        result_keys = _artifact_keys(client, run.id)
    assert "train" in result_keys
    metrics = (home / "two" / name / "runs").rglob("*.jsonl")
    assert any('"step": 2' in p.read_text() for p in metrics)
