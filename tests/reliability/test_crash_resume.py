"""Crash and resume under fire: one training run SIGKILLed five times, at fault points inside a step, a checkpoint
upload to S3 and a weight publication, and once from outside at a random moment; every `--resume` continues from
the newest complete checkpoint, and the finished run holds versions 1..N once each, in the JSON lines and in
MLflow. Then the same for a Prefect `pipeline` flow run killed in its training stage."""

import contextlib
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from components.tracking import DiskTracker
from tests.cli_args import SMALL_PIPELINE, SMALL_TRAIN, sets
from tests.conftest import child_env

pytestmark = pytest.mark.reliability

TARGET = 12
BUCKET = "crash"
TRAIN = [
    sys.executable,
    "-m",
    "components.cli",
    "train",
    "--max-steps",
    str(TARGET),
    *sets({"train.backend": '"torch"', **SMALL_TRAIN}),
]
RESUMED = re.compile(r"train: resumed from \S+/step-(\d{8}) \(version (\d+)\)")


def _s3(endpoint: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )


def _checkpoints(s3, prefix: str) -> tuple[list[int], list[int]]:
    """(complete steps, steps with objects but no completion marker) under `prefix` in the bucket."""
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    steps: dict[int, bool] = {}
    for key in keys:
        match = re.search(r"/step-(\d{8})/(.+)$", key)
        if match:
            step = int(match.group(1))
            steps[step] = steps.get(step, False) or match.group(2) == "_COMPLETE"
    return sorted(s for s, done in steps.items() if done), sorted(s for s, done in steps.items() if not done)


def _train(args: list[str], env: dict, fault: str | None, kill_after_step: float | None = None):
    """One `sao train` process: with `fault` in SAO_FAULTS it kills itself there; with `kill_after_step` it is
    SIGKILLed from outside that many seconds after it logs its first step. Returns (returncode, output)."""
    env = {**env, "SAO_FAULTS": fault or ""}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        lines.append(line)
        if kill_after_step is not None and re.search(r"\bstep +\d+/\d+ ", line):
            time.sleep(kill_after_step)
            proc.send_signal(signal.SIGKILL)
            kill_after_step = None
        assert time.monotonic() < deadline, "".join(lines[-40:])
    return proc.wait(), "".join(lines)


def test_five_kills_then_resume_give_every_version_once(seeded_home, prefect_env, moto_endpoint):
    with contextlib.ExitStack() as stack:
        _five_kills(seeded_home, prefect_env, moto_endpoint, stack)


def _five_kills(seeded_home, prefect_env, moto_endpoint, stack) -> None:
    import httpx

    from components.rollout.server import serve_subprocess

    s3 = _s3(moto_endpoint)
    s3.create_bucket(Bucket=BUCKET)
    env = child_env(
        **prefect_env,
        AWS_ENDPOINT_URL=moto_endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        SAO_STORE_URI=f"s3://{BUCKET}/sao",
    )
    home = seeded_home
    engine = stack.enter_context(serve_subprocess(home / "models" / "sft-tir_math", threads=1))
    # The engine outlives every trainer it serves: a resumed trainer finds it ahead of its checkpoint (it loaded
    # versions the crashed run published after that) and rewinds it.
    args = TRAIN + ["--home", str(home), "--set", 'rollout.backend="http"', "--set", f'rollout.urls=["{engine}"]']
    rng = random.Random(13)
    # Fault points count their hits from each process's start, so each is aimed past its run's resume point;
    # None is a SIGKILL from outside at a random moment after the run's first step. Checkpoints (every 2 steps)
    # upload in the background, one in flight, so a run resumed from n and killed after its 4th step has n + 2
    # complete whatever the timing: step@5 and publish@6 move the newest checkpoint on, the uploads' kills do not.
    faults = ["trainer.step@5", "store.upload@2", "weights.publish@6", None, "store.upload@1"]
    prefix = "sao/checkpoints/tiny-cpu/"
    newest, outputs, ahead = [], [], []
    for i, fault in enumerate(faults + ["done"]):
        run_args = args + (["--resume"] if i else [])
        if fault == "done":
            code, out = _train(run_args, env, None)
            assert code == 0, out[-3000:]
        else:
            code, out = _train(run_args, env, fault, kill_after_step=None if fault else rng.uniform(0.2, 1.5))
            assert code == -signal.SIGKILL, f"run {i} ({fault}) was not killed:\n{out[-3000:]}"
        outputs.append(out)
        complete, partial = _checkpoints(s3, prefix)
        if fault and fault.startswith("store.upload"):
            assert partial, f"run {i}: the kill at {fault} left no partial checkpoint (complete: {complete})"
        newest.append(complete[-1])
        ahead.append(httpx.get(f"{engine}/health", timeout=5).json()["version"] > complete[-1])
    print(f"newest complete checkpoint after each run: {newest}; engine ahead of it: {ahead}")
    # Every resume started from the newest complete checkpoint at the moment of the kill before it.
    starts = [[int(m.group(1)) for m in RESUMED.finditer(out)] for out in outputs[1:]]
    assert starts == [[n] for n in newest[:-1]], starts
    assert newest[0] >= 2 and newest[2] >= newest[1] + 2, newest  # the kills landed at different places of the run
    assert any(ahead), "no kill left the engine ahead of the newest checkpoint: the rewind went untested"
    health = httpx.get(f"{engine}/health", timeout=5).json()
    assert health["version"] == TARGET and health["path"].endswith(f"published/v{TARGET:08d}")
    assert complete[-1] == TARGET
    records = DiskTracker.read(home / "runs" / "tiny-cpu" / "sao.jsonl")
    assert [r["step"] for r in records if "policy/loss" in r.get("metrics", {})] == list(range(1, TARGET + 1))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home.resolve()}/mlflow.db")
    runs = client.search_runs(
        [client.get_experiment_by_name("sao").experiment_id], order_by=["attributes.start_time ASC"]
    )
    assert [r.info.status for r in runs] == ["KILLED"] * len(faults) + ["FINISHED"]
    history = [m.step for m in client.get_metric_history(runs[-1].info.run_id, "policy/loss")]
    assert history == list(range(1, TARGET + 1))


PIPELINE = [sys.executable, "-m", "components.cli", "pipeline", *sets(SMALL_PIPELINE)]


def test_a_pipeline_killed_in_training_reruns_without_redoing_its_stages(tmp_path, prefect_env, moto_endpoint):
    """`sao pipeline` (a Prefect flow run) SIGKILLed inside its train stage; the re-run reuses the dataset, the
    SFT policy and the critic as they are in the store (not one object rewritten) and resumes training."""
    s3 = _s3(moto_endpoint)
    s3.create_bucket(Bucket="pipeline-kill")
    env = child_env(
        **prefect_env,
        AWS_ENDPOINT_URL=moto_endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        SAO_STORE_URI="s3://pipeline-kill/sao",
    )
    args = PIPELINE + ["--home", str(tmp_path / "home")]

    def stored() -> dict[str, object]:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket="pipeline-kill", Prefix="sao/")
        return {o["Key"]: o["LastModified"] for page in pages for o in page.get("Contents", [])}

    code, out = _train(args, env, "trainer.step@3")
    assert code == -signal.SIGKILL, out[-3000:]
    before = stored()
    assert "sao/checkpoints/tiny-cpu/step-00000002/_COMPLETE" in before
    assert "sao/checkpoints/tiny-cpu/step-00000004/_COMPLETE" not in before
    code, out = _train(args, env, None)
    assert code == 0, out[-3000:]
    after = stored()
    finished = [k for k in before if not k.startswith("sao/checkpoints/")]
    assert finished and {k: after.get(k) for k in finished} == {k: before[k] for k in finished}
    assert "distill: " in out and "skipped" in out
    assert [m.group(1) for m in RESUMED.finditer(out)] == ["00000002"]
    assert "sao/checkpoints/tiny-cpu/step-00000004/_COMPLETE" in after
    records = DiskTracker.read(tmp_path / "home" / "runs" / "tiny-cpu" / "sao.jsonl")
    assert [r["step"] for r in records if "policy/loss" in r.get("metrics", {})] == [1, 2, 3, 4]
