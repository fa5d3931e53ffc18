"""A store outage longer than its retries, in the middle of a run: the checkpoint it hits is not stored, training
goes on and the next checkpoint is; `train.checkpoint_failures` in a row is the most a run takes. The store is
moto's S3 server behind the fault proxy, which drops every request for one checkpoint's objects. Checkpoints are
published in the background: a failure is counted when the loop next waits for the upload (the next save, the
guard's roll back, the end of the run)."""

from dataclasses import replace

import pytest

from components.storage import StoreError
from components.tracking import NullTracker
from tests.faultproxy import FaultProxy
from tests.training.test_trainer_loop import _cfg, train_env

BUCKET = "outage"


@pytest.fixture
def proxied_s3(s3_env, moto_endpoint, monkeypatch):
    import boto3

    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket=BUCKET)
    with FaultProxy(moto_endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy, s3


def _outage_cfg(tiny_cfg, prefix: str, **train):
    cfg = _cfg(tiny_cfg, max_steps=4, **train)
    # Two quick tries per object: the outage outlasts the store's retries in well under a second.
    return replace(cfg, store=replace(cfg.store, uri=f"s3://{BUCKET}/{prefix}", attempts=2, backoff_s=0.05))


def _complete(s3, prefix: str) -> list[int]:
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]
    return sorted(int(k.split("step-")[1][:8]) for k in keys if k.endswith("/_COMPLETE"))


def test_a_checkpoint_lost_to_an_outage_does_not_stop_training(proxied_s3, tmp_path, tiny_cfg, sft_dir):
    proxy, s3 = proxied_s3
    proxy.mode("down", match="step-00000002/")  # every request for checkpoint 2, through all its retries
    log = []
    result = train_env(_outage_cfg(tiny_cfg, "a"), sft_dir, tmp_path, NullTracker(), log=log.append)
    assert result.version == 4
    assert _complete(s3, "a/") == [0, 1, 3, 4]  # 2 never completed; the next ones did
    # Checkpoint 2 uploads while step 3 trains; the save after step 3's row waits for it and counts the failure,
    # so the row of step 4 is the first to show it.
    assert [row["trainer/checkpoint_failures"] for row in result.history] == [0.0, 0.0, 0.0, 1.0]
    assert any("checkpoint 2 not stored" in line and "training goes on" in line for line in log)


def test_more_failures_in_a_row_than_allowed_stop_the_run(proxied_s3, tmp_path, tiny_cfg, sft_dir):
    proxy, _ = proxied_s3
    proxy.mode("down", match="step-00000002/")
    with pytest.raises(StoreError, match=r"s3://outage/b/checkpoints/.*/step-00000002"):
        train_env(
            _outage_cfg(tiny_cfg, "b", checkpoint_failures=0), sft_dir, tmp_path, NullTracker(), log=lambda _: None
        )


def test_a_store_that_never_took_a_checkpoint_stops_the_run_at_the_next_save(proxied_s3, tmp_path, tiny_cfg, sft_dir):
    proxy, _ = proxied_s3
    proxy.mode("down", match="step-00000000/")  # the starting weights' checkpoint: a broken store, not an outage
    with pytest.raises(StoreError, match="step-00000000"):
        train_env(_outage_cfg(tiny_cfg, "c"), sft_dir, tmp_path, NullTracker(), log=lambda _: None)


def _checkpointer(prefix: str, max_failures: int, tmp_dir, keep: int = 0):
    from components.storage import open_store
    from components.training.rl.checkpoint import Checkpointer, CheckpointStore

    store = open_store(f"s3://{BUCKET}/{prefix}", attempts=2, backoff_s=0.05)
    stored, log = [], []
    checkpoints = Checkpointer(
        CheckpointStore(store, "run", tmp_dir),
        max_failures,
        on_checkpoint=lambda step, uri: stored.append((step, uri)),
        log=log.append,
        keep=keep,
    )
    return checkpoints, stored, log


def test_the_checkpointer_spends_its_budget_on_failures_in_a_row(proxied_s3, tmp_path):
    """Budget 1: step 0 stored; 1 lost (1 in a row, within budget: logged); 2 stored (the count starts over); 3
    lost (1 in a row again); 4 lost too (2 in a row > 1): raised. Each upload runs on its own thread (joined here
    so that the proxy's mode holds for all of it); its outcome is counted only when the next `save` or `wait`
    waits for it. Only stored steps are announced."""
    import torch

    proxy, s3 = proxied_s3
    checkpoints, stored, log = _checkpointer("budget", 1, tmp_path)
    payload = {"weights": torch.arange(4.0)}
    checkpoints.save(0, payload)
    assert checkpoints.wait().endswith("budget/run/step-00000000")
    for step, down in ((1, True), (2, False), (3, True), (4, True)):
        proxy.mode("down", match=f"step-{step:08d}/") if down else proxy.mode("pass")
        checkpoints.save(step, payload)  # counts the previous upload, starts this one
        counted = checkpoints.failed
        assert counted == {1: 0, 2: 1, 3: 1, 4: 2}[step]  # the failures of the steps before this one
        checkpoints.in_flight.join()
        assert checkpoints.failed == counted  # this one's, over or not, is counted only when waited for
    with pytest.raises(StoreError, match="step-00000004"):
        checkpoints.wait()
    assert [s for s, _ in stored] == [0, 2] and all(uri.endswith(f"step-{s:08d}") for s, uri in stored)
    assert (checkpoints.stored, checkpoints.failed, checkpoints.failed_in_a_row) == (2, 3, 2)
    assert [line.split(" (")[0] for line in log] == ["train: checkpoint 1 not stored", "train: checkpoint 3 not stored"]
    assert _complete(s3, "budget/") == [0, 2]
    assert checkpoints.wait() is None and checkpoints.in_flight is None  # nothing left in flight


def test_the_checkpointer_never_forgives_the_first_or_the_final_checkpoint(proxied_s3, tmp_path):
    import torch

    proxy, _ = proxied_s3
    first, _, _ = _checkpointer("first", 5, tmp_path)
    proxy.mode("down", match="step-00000000/")
    first.save(0, {"x": torch.zeros(1)})
    first.in_flight.join()
    proxy.mode("pass")
    with pytest.raises(StoreError, match="step-00000000"):  # nothing stored yet: a broken store, not an outage
        first.save(1, {"x": torch.zeros(1)})  # the next save raises it, before writing anything
    assert first.in_flight is None and not list(tmp_path.glob(".save-*"))  # 0's scratch went, 1 was never written
    final, _, _ = _checkpointer("final", 5, tmp_path)
    final.save(0, {"x": torch.zeros(1)})
    assert final.wait() is not None
    proxy.mode("down", match="step-00000007/")
    final.save(7, {"x": torch.zeros(1)}, final=True)
    with pytest.raises(StoreError, match="step-00000007"):  # the run's last checkpoint holds its result
        final.wait()


def test_the_newest_checkpoints_are_kept_and_a_failed_deletion_is_retried_at_the_next(proxied_s3, tmp_path):
    """`train.keep_checkpoints = 2`: once a checkpoint is complete the ones older than the newest two are deleted,
    on the upload's thread. A deletion the store fails (an outage on step 1's objects) is logged and the run goes
    on; the next checkpoint deletes what is still beyond the two."""
    import torch

    proxy, s3 = proxied_s3
    checkpoints, stored, log = _checkpointer("keep", 5, tmp_path, keep=2)
    payload = {"weights": torch.arange(4.0)}
    complete = []
    for step in range(5):
        proxy.mode("down", match="step-00000001/") if step == 3 else proxy.mode("pass")
        checkpoints.save(step, payload)
        checkpoints.wait()
        complete.append(_complete(s3, "keep/"))
    assert complete == [[0], [0, 1], [1, 2], [1, 2, 3], [3, 4]]
    assert [s for s, _ in stored] == [0, 1, 2, 3, 4] and checkpoints.failed == 0
    assert log[0] == "checkpoint: deleted step 0 (train.keep_checkpoints=2 newest are kept)"
    assert log[1].startswith("checkpoint: could not delete old checkpoints after step 3: ")
    assert log[2:] == [f"checkpoint: deleted step {s} (train.keep_checkpoints=2 newest are kept)" for s in (1, 2)]
    left = {o["Key"].split("/")[2] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="keep/").get("Contents", [])}
    assert left == {"step-00000003", "step-00000004"}  # every object of the deleted ones went, not only the marker
