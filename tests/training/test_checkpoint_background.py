"""Checkpoints published in the background (issue 42, item 10): the loop writes a checkpoint locally and trains on
while a thread hashes and uploads it. The store here is `HeldStore` (tests/training/held_store.py), the local store
holding one checkpoint's upload until the test releases it; the tests assert the order of events, never timings.

Before the change, the held upload ran on the loop's thread: nothing released it, it waited out its patience and
recorded "upload N timed out", and every test here failed on that."""

import signal
import subprocess
import sys
from pathlib import Path

from components.training.rl.checkpoint import LocalCheckpointStore
from tests.conftest import child_env
from tests.training.held_store import Events, HeldStore, held_run, tiny
from tests.training.test_trainer_loop import _FireAt

REPO = Path(__file__).resolve().parents[2]


def test_the_loop_trains_on_while_a_checkpoint_uploads(tmp_path, sft_dir):
    events = Events()
    store = HeldStore(tmp_path, held=1, events=events)
    result = held_run(tiny(3), sft_dir, tmp_path, store, log=lambda _: None)
    assert result.version == 3
    assert "upload 1 timed out" not in events.seen
    # Checkpoint 1 was written after step 1's row; its upload was released by step 2's row, so step 2 trained
    # while it was in flight; it was announced only once complete in the store.
    assert events.before("row 1", "upload 1 released") and events.before("row 2", "upload 1 released")
    assert events.before("upload 1 released", "stored 1") and events.before("stored 1", "announced 1")
    # One checkpoint in flight at a time: the save after step 2 waited for 1 before 2 was published.
    assert events.before("stored 1", "stored 2")
    # Every checkpoint (0: the starting weights) complete, each announced after it was stored; the run ended
    # only once the last was.
    assert LocalCheckpointStore(tmp_path / "checkpoints" / "tiny-cpu").steps() == [0, 1, 2, 3]
    assert [e for e in events.seen if e.startswith("announced")] == [f"announced {s}" for s in range(4)]
    assert all(events.before(f"stored {s}", f"announced {s}") for s in range(4))


class _FireAndRelease(_FireAt):
    """The collapse rule firing after step 3 (last good step: 2), and releasing the held upload of checkpoint 2
    as it fires: the guard's roll back begins while that checkpoint is still being published."""

    def __init__(self, store: HeldStore) -> None:
        super().__init__(3)
        self.store = store

    def update(self, step: int, reward: float):
        collapse = super().update(step, reward)
        if collapse is not None:
            self.store.events("collapse")
            self.store.release.set()
        return collapse


def test_the_guard_rolls_back_to_a_checkpoint_only_once_it_is_complete(tmp_path, sft_dir):
    events, log = Events(), []
    store = HeldStore(tmp_path, held=2, events=events, release_row=None)  # the collapse releases it
    cfg = tiny(4, "train.checkpoint_every=2", "train.sync=true")
    result = held_run(cfg, sft_dir, tmp_path, store, detector=_FireAndRelease(store), log=log.append)
    assert "upload 2 timed out" not in events.seen
    assert events.before("row 3", "collapse") and events.before("collapse", "upload 2 released")
    # The guard waited for checkpoint 2 to be complete and returned to it, not to the older step 0.
    assert any("rolled back to the checkpoint of step 2 as version 4" in line for line in log), log
    assert result.version == 4


def test_a_kill_during_a_background_upload_resumes_from_the_checkpoint_before(tmp_path, sft_dir):
    """A run resumed at step 2 is killed (SAO_FAULTS, SIGKILL) after the second file of checkpoint 3 is stored,
    the upload held until step 4's row was logged: the loop had trained past the checkpoint when its upload died.
    Checkpoint 2 stays the newest complete one, and the next resume starts from it."""
    home, log = tmp_path / "home", []
    checkpoints = LocalCheckpointStore(home / "checkpoints" / "tiny-cpu")
    held_run(tiny(2), sft_dir, home, HeldStore(home, held=-1, events=Events()), log=lambda _: None)
    assert checkpoints.steps() == [0, 1, 2]

    events = tmp_path / "events.txt"
    env = child_env(SAO_FAULTS="store.upload@2")  # this process's 2nd stored file: checkpoint 3's 2nd
    env.pop("SAO_STORE_URI", None)
    child = [sys.executable, "-m", "tests.training.held_store", str(home), str(sft_dir), str(events), "4", "3"]
    done = subprocess.run(child, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stdout[-3000:] + done.stderr[-3000:]
    seen = events.read_text().splitlines()
    assert seen == ["row 3", "row 4", "upload 3 released"], seen  # killed inside the upload, after row 4
    assert checkpoints.steps() == [0, 1, 2]
    assert list((home / "checkpoints" / "tiny-cpu").glob(".step-00000003.tmp-*"))  # the files it had stored

    result = held_run(tiny(4), sft_dir, home, HeldStore(home, held=-1, events=Events()), resume=True, log=log.append)
    assert any("resumed from" in line and "step-00000002 (version 2)" in line for line in log), log
    assert result.version == 4 and checkpoints.steps() == [0, 1, 2, 3, 4]
