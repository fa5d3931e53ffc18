"""Trajectory buffer admission control and grouping; checkpoint store integrity."""

import asyncio

import pytest
import torch

from components.contracts.task import Task
from components.contracts.trajectory import Timings, Trajectory
from components.storage import CorruptArtifact, IncompleteArtifact
from components.training.rl.buffer import TrajectoryBuffer
from components.training.rl.checkpoint import LocalCheckpointStore


def _traj(pid):
    return Trajectory(
        pid, "tir_math", [1, 2, 3], [0, 1, 1], [None, -0.1, -0.2], [None, 0, 0], 1.0, 1, "stop", 1, Timings(queued=0.0)
    )


def test_capacity_admission_bounds_episodes_started_per_version():
    async def scenario():
        buffer = TrajectoryBuffer(max_staleness=1, batch_size=2)  # (v + 1 + 1) * 2 starts allowed at version v
        for i in range(4):
            await buffer.admit(Task(f"e{i}", "q"))  # 4 starts at version 0
        waiting = asyncio.create_task(buffer.admit(Task("e4", "q")))
        await asyncio.sleep(0.05)
        assert not waiting.done() and buffer.admission_waits == 1
        await buffer.put(_traj("e1"))  # finishing does not free capacity: training does
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await buffer.set_version(1)  # (1 + 2) * 2 = 6 > 4 started
        await asyncio.wait_for(waiting, 1)
        await buffer.admit(Task("e5", "q"))
        assert buffer.started == 6 and not buffer.admissible()
        # A straggler does not stall new starts: e0 (version 0) is still in flight at version 3.
        await buffer.set_version(3)
        assert buffer.admissible() and buffer.start_version_counts()[0] == 3
        # Resumed at version 5: it has trained on 10 episodes, so 10 more may start at once.
        resumed = TrajectoryBuffer(max_staleness=0, batch_size=10, version=5)
        assert resumed.started == 50 and resumed.admissible()

    asyncio.run(scenario())


def test_a_discarded_episode_gives_its_admission_slot_back():
    async def scenario():
        buffer = TrajectoryBuffer(max_staleness=0, batch_size=2)  # (0 + 0 + 1) * 2 = 2 starts at version 0
        await buffer.admit(Task("e0", "q"))
        await buffer.admit(Task("e1", "q"))
        assert not buffer.admissible()
        await buffer.discard(_traj("e1"))  # every engine failed e1: it will never arrive
        assert buffer.started == 1 and buffer.discarded == 1 and buffer.admissible()
        assert buffer.start_version_counts() == {0: 1} and buffer.ready == 0
        await buffer.admit(Task("e2", "q"))
        await buffer.put(_traj("e0"))
        await buffer.put(_traj("e2"))
        assert [t.prompt_id for t in await buffer.take(2)] == ["e0", "e2"]
        with pytest.raises(ValueError, match="group"):
            await TrajectoryBuffer(max_staleness=0, batch_size=4, group_size=2).discard(_traj("g#g0"))

    asyncio.run(scenario())


def test_buffer_rejects_bad_settings():
    with pytest.raises(ValueError, match="rule"):
        TrajectoryBuffer(1, rule="fifo")
    with pytest.raises(ValueError, match="batch_size"):
        TrajectoryBuffer(1, batch_size=0)


def test_oldest_admission_waits_for_the_oldest_in_flight_episode():
    async def scenario():
        buffer = TrajectoryBuffer(max_staleness=1, rule="oldest")
        await buffer.admit(Task("old", "q"))  # starts at version 0
        await buffer.set_version(1)
        await buffer.admit(Task("fresh", "q"))  # 1 - 0 <= 1: admitted
        await buffer.set_version(2)  # now 2 - 0 > 1: the next start must wait for "old"
        waiting = asyncio.create_task(buffer.admit(Task("next", "q")))
        await asyncio.sleep(0.05)
        assert not waiting.done() and buffer.admission_waits == 1
        await buffer.put(_traj("old"))  # oldest in flight is now "fresh" (version 1): 2 - 1 <= 1
        await asyncio.wait_for(waiting, 1)
        assert buffer.in_flight == 2
        # Finished work is never dropped for staleness, however stale.
        await buffer.set_version(50)
        await buffer.put(_traj("fresh"))
        assert [t.prompt_id for t in await buffer.take(2)] == ["old", "fresh"]

    asyncio.run(scenario())


def test_grouped_buffer_releases_whole_groups_only():
    async def scenario():
        buffer = TrajectoryBuffer(max_staleness=0, batch_size=2, group_size=2)
        await buffer.put(_traj("a#g0"))
        await buffer.put(_traj("b#g0"))
        take = asyncio.create_task(buffer.take(2))
        await asyncio.sleep(0.05)
        assert not take.done()  # two trajectories are finished, but no group is complete: the GRPO barrier
        await buffer.put(_traj("b#g1"))
        assert [t.prompt_id for t in await asyncio.wait_for(take, 1)] == ["b#g0", "b#g1"]

    asyncio.run(scenario())


def test_checkpoints_are_verified_and_incomplete_ones_ignored(tmp_path):
    store = LocalCheckpointStore(tmp_path)
    store.save(1, {"policy": {"w": torch.ones(3)}, "state": {"step": 1}})
    store.save(2, {"policy": {"w": torch.full((3,), 2.0)}, "state": {"step": 2}})
    (tmp_path / "step-00000003").mkdir()  # a crash mid-write: no marker
    (tmp_path / "step-00000003" / "policy.pt").write_bytes(b"partial")
    assert store.steps() == [1, 2] and store.latest_step() == 2
    assert torch.equal(store.load(2)["policy"]["w"], torch.full((3,), 2.0))
    with pytest.raises(IncompleteArtifact, match="no _COMPLETE marker"):
        store.load(3)
    (tmp_path / "step-00000002" / "policy.pt").write_bytes(b"corrupted")
    with pytest.raises(CorruptArtifact, match="policy.pt has 9 bytes"):
        store.load(2)


def test_a_rollback_deletes_the_checkpoints_after_a_verified_step_and_only_then(tmp_path):
    store = LocalCheckpointStore(tmp_path)
    for step in (0, 5, 10, 15):
        store.save(step, {"policy": {"w": torch.full((2,), float(step))}})
    log: list[str] = []
    assert store.discard_after(5, log.append) == [10, 15]
    assert store.steps() == [0, 5] and not (tmp_path / "step-00000015").exists()
    assert log == [
        "checkpoint: deleted step 15 (rolled back to step 5)",
        "checkpoint: deleted step 10 (rolled back to step 5)",
    ]
    with pytest.raises(ValueError, match=r"--rollback-to: no complete checkpoint at step 7 .* complete: \[0, 5\]"):
        store.discard_after(7, log.append)
    # a target that does not verify deletes nothing
    (tmp_path / "step-00000000" / "policy.pt").write_bytes(b"corrupted")
    with pytest.raises(CorruptArtifact):
        store.discard_after(0, log.append)
    assert store.steps() == [0, 5]
