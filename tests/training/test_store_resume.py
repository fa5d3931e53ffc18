"""Checkpoints and models in S3 (moto's real HTTP server): a run resumes on a machine whose home is empty."""

import uuid

import boto3
import pytest

from components.cli import main
from components.config import load_config
from components.stages.train import run_train


@pytest.mark.reliability  # a whole process killed or resumed: make test-reliability (CI runs it)
def test_a_run_resumes_from_s3_alone(tmp_path, seeded_home, s3_env):
    bucket = f"runs-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)

    def cfg(max_steps: int):
        return load_config(
            "tiny-cpu",
            [
                f'store.uri="s3://{bucket}/team"',
                f"train.max_steps={max_steps}",
                "train.batch_size=4",
                "train.checkpoint_every=1",
                'train.backend="torch"',
                "rollout.concurrency=4",
                "task.eval_size=8",
                'tracking.backend="disk"',
            ],
        )

    first = run_train(cfg(2), seeded_home, log=lambda _: None)
    assert first["version"] == 2
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"]}
    for artifact in ("models/sft-tir_math", "models/tiny-cpu-sao-policy", "checkpoints/tiny-cpu/step-00000002"):
        assert f"team/{artifact}/_COMPLETE" in keys, artifact
    assert not (seeded_home / "checkpoints").exists(), "with a store configured, checkpoints live only there"

    empty, log = tmp_path / "elsewhere", []
    second = run_train(cfg(4), empty, resume=True, log=log.append)
    assert second["version"] == 4
    assert f"store: fetched s3://{bucket}/team/models/sft-tir_math" in log
    assert f"train: resumed from s3://{bucket}/team/checkpoints/tiny-cpu/step-00000002 (version 2)" in log
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"]}
    assert {f"team/checkpoints/tiny-cpu/step-{s:08d}/_COMPLETE" for s in range(5)} <= keys


def test_a_store_that_cannot_be_written_is_a_clear_error(seeded_home, s3_env, capsys, prefect_api):
    """A bucket that does not exist: one `sao:` line naming the store's URI, before anything is trained (the first
    thing `sao train` asks the store is whether it holds an earlier run's checkpoints)."""

    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "train",
                "--home",
                str(seeded_home),
                "--max-steps",
                "1",
                "--set",
                'store.uri="s3://no-such-bucket/x"',
                "--set",
                'tracking.backend="disk"',
            ]
        )
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the flow's own log lines, when they go there
    assert last.startswith("sao: s3://no-such-bucket/x/checkpoints/tiny-cpu: ") and "bucket does not exist" in last
