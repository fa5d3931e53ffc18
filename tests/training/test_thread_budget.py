"""The default split of torch threads between the embedded engine and the trainer (`thread_budget`)."""

import pytest

from components.config import load_config
from components.training.rl.parts import thread_budget


@pytest.mark.parametrize(
    "overrides, cores, split",
    [
        ([], 2, (1, 1)),  # async: half each
        ([], 8, (4, 4)),
        ([], 1, (1, 1)),  # never zero threads
        (["train.sync=true"], 2, (1, 2)),  # sync: the engine keeps half, the trainer takes turns on all
        (["train.sync=true"], 8, (4, 8)),
        (["rollout.engine_threads=3"], 8, (3, 5)),  # explicit values win; the trainer gets the rest
        (["train.sync=true", "rollout.engine_threads=2", "train.threads=1"], 8, (2, 1)),
        (['rollout.backend="http"', 'rollout.urls=["http://a:1"]'], 8, (8, 8)),  # no engine here: all to the trainer
    ],
)
def test_default_thread_split(overrides, cores, split):
    assert thread_budget(load_config("tiny-cpu", overrides), cores=cores) == split


def test_each_torchrun_rank_takes_its_share_of_the_machines_cores(monkeypatch):
    """16 cores, 8 ranks on this machine (torchrun's LOCAL_WORLD_SIZE): 2 cores a rank, so the trainer of an http
    run gets 2 threads, not 16 (eight ranks of 16 threads each would fight for the same cores)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = load_config("tiny-cpu", ['rollout.backend="http"', 'rollout.urls=["http://a:1"]'])
    assert thread_budget(cfg) == (2, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")  # more ranks than cores: never zero threads
    assert thread_budget(cfg) == (1, 1)
