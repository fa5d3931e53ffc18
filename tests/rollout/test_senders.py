"""Weights from every rank (components/rollout/senders.py) against real `sao engine serve` servers: rank 0's
transport and a follower sender (a thread of this process standing for rank 1) each send their buckets over a gloo
pair group of their own with each server; the probe checks every version. A version the follower did not stage goes
from rank 0 alone; a follower that is gone costs the collective path that version (the filesystem takes it), never
the version. The two-rank run under torchrun: `make rehearse` (the GPU presets send from every rank)."""

import asyncio
import threading

import httpx
import pytest
import torch
from torch.distributed import TCPStore

from components.rollout.backends import HttpRollouts
from components.rollout.pairs import pair_group
from components.rollout.senders import FollowerSender, Share
from components.rollout.transfer import ALIGN, pack, plan_buckets, receive_buckets, send_buffers
from tests.rollout.test_backends import _config, _request, _version, _weights


def _rollouts(urls, model, tokenizer, publish_dir, senders=2, **fields) -> HttpRollouts:
    settings = {
        "weight_transfer": "collective",
        "transfer_senders": "all",
        "transfer_bucket_mb": 1,  # the tiny policy's ~3 MB in several buckets: each sender has some
        "probe_every": 1,
        "transfer_timeout_s": 20.0,
        **fields,
    }
    return HttpRollouts(_config(urls, **settings), model, tokenizer, publish_dir, senders=senders)


def test_every_sender_sends_its_buckets_to_every_server_and_the_probe_agrees(tiny, serve, tmp_path):
    model, tokenizer = tiny
    a, b = serve(model, tokenizer), serve(model, tokenizer)
    versions = {v: _version(model, seed=v) for v in (1, 2, 3)}

    async def run():
        rollouts = _rollouts([a.url, b.url], model, tokenizer, tmp_path / "p")
        await rollouts.start()  # v0: staged by rank 0 only (the followers stage what the learner gathers)
        seen, follower = [(rollouts.metrics()["rollout/transfer_senders"], None)], None
        for v, state in versions.items():
            weights = _weights(state)
            share = rollouts.share(v)
            follower = follower or FollowerSender(1, share)
            follower.stage(share, weights)
            share.staged = True  # what the learner's gather says once every follower has staged it
            await rollouts.publish(weights, v)
            health = [httpx.get(f"{s.url}/health").json()["version"] for s in (a, b)]
            seen.append((rollouts.metrics()["rollout/transfer_senders"], health))
        result = await rollouts.engine.generate(_request(tokenizer, 3))
        metrics = rollouts.metrics()
        await rollouts.close()
        follower.close()
        return seen, share, result, metrics

    seen, share, result, metrics = asyncio.run(run())
    assert len(share.buckets) >= 3 and list(share.indices(1)) == list(range(1, len(share.buckets), 2))
    assert seen == [(1.0, None), (2.0, [1, 1]), (2.0, [2, 2]), (2.0, [3, 3])]
    assert set(result.versions) == {3}
    assert metrics["rollout/probe_failures"] == 0 and metrics["rollout/probe_median_abs_diff"] < 1e-5
    assert metrics["rollout/transfer_fallbacks"] == 0 and metrics["rollout/transfer_retries"] == 0
    assert not (tmp_path / "p").exists()  # nothing went through the filesystem


def test_a_version_the_followers_did_not_stage_goes_from_rank_0_alone(tiny, serve, tmp_path):
    model, tokenizer = tiny
    a = serve(model, tokenizer)

    async def run():
        rollouts = _rollouts([a.url], model, tokenizer, tmp_path / "p")
        await rollouts.start()
        share = rollouts.share(1)
        follower = FollowerSender(1, share)
        follower.stage(share, _weights(_version(model, seed=1)))
        share.staged = True
        await rollouts.publish(_weights(_version(model, seed=1)), 1)
        both = rollouts.metrics()["rollout/transfer_senders"]
        rollouts.share(2)  # not staged: the learner's gather said a follower failed
        await rollouts.publish(_weights(_version(model, seed=2)), 2)
        metrics = rollouts.metrics()
        await rollouts.close()
        follower.close()
        return both, metrics

    both, metrics = asyncio.run(run())
    assert both == 2.0 and metrics["rollout/transfer_senders"] == 1.0
    assert httpx.get(f"{a.url}/health").json()["version"] == 2
    assert metrics["rollout/probe_failures"] == 0 and metrics["rollout/transfer_fallbacks"] == 0


def test_a_follower_that_is_gone_costs_the_collective_path_not_the_version(tiny, serve, tmp_path):
    """No follower runs, but the share says it staged the version: the server's group with sender 1 never forms, the
    transport retries on a new group, then sends the version through the filesystem; the server serves it."""
    model, tokenizer = tiny
    a = serve(model, tokenizer)
    lines: list[str] = []

    async def run():
        rollouts = _rollouts([a.url], model, tokenizer, tmp_path / "p", transfer_timeout_s=2.0)
        rollouts.log = lines.append
        await rollouts.start()  # v0's group is formed with both senders: no follower answers
        share = rollouts.share(1)
        share.staged = True
        await rollouts.publish(_weights(_version(model, seed=1)), 1)
        metrics = rollouts.metrics()
        await rollouts.close()
        return metrics

    metrics = asyncio.run(run())
    assert httpx.get(f"{a.url}/health").json()["version"] == 1
    assert metrics["rollout/transfer_fallbacks"] >= 1 and metrics["rollout/probe_failures"] == 0
    assert any("through the filesystem" in line for line in lines), lines


@pytest.mark.parametrize("workers", [1, 2])
def test_buckets_from_two_senders_reach_every_worker_in_their_order_over_their_own_groups(workers):
    """`receive_buckets` over two groups, one a sender: bucket i from sender i mod 2; sizes differ, so a bucket taken
    from the wrong sender would not even unpack. With two workers (a vLLM with tensor parallelism: ranks 1 and 2 of
    each group, as `join_group` makes them) each worker receives every bucket from one broadcast of its sender."""
    weights = {f"w{i}": torch.full((10 + 7 * i,), float(i)) for i in range(7)}
    buckets = plan_buckets(weights, bucket_bytes=ALIGN)  # one tensor a bucket
    buffers = [pack(weights, bucket, torch.device("cpu")) for bucket in buckets]
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    groups: dict[tuple[int, int], object] = {}
    ranks = range(1 + workers)

    def form(index: int, rank: int) -> None:  # a client of its own: one holds its lock through a blocking wait
        client = TCPStore("127.0.0.1", store.port, None, False)
        groups[(index, rank)] = pair_group(client, f"g.{index}", rank, "gloo", "127.0.0.1", 20.0, 1 + workers)

    _all([threading.Thread(target=form, args=(i, r)) for i in (0, 1) for r in ranks])
    received: dict[int, dict[str, torch.Tensor]] = {rank: {} for rank in ranks[1:]}
    totals: dict[int, int] = {}

    def worker(rank: int) -> None:
        mine = [groups[(0, rank)], groups[(1, rank)]]
        totals[rank] = receive_buckets(mine, buckets, received[rank].update, 20.0)

    _all(
        [threading.Thread(target=worker, args=(rank,)) for rank in ranks[1:]]
        + [threading.Thread(target=send_buffers, args=(groups[(i, 0)], buffers[i::2], 20.0)) for i in (0, 1)]
    )
    assert totals == {rank: sum(b.numel() for b in buffers) for rank in ranks[1:]}
    for got in received.values():
        assert list(got) == list(weights) and all(torch.equal(got[k], v) for k, v in weights.items())


def _all(threads: list[threading.Thread]) -> None:
    """Start every thread, then join them all."""
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_a_share_names_each_senders_buckets():
    weights = {f"w{i}": torch.zeros(4) for i in range(5)}
    buckets = plan_buckets(weights, bucket_bytes=ALIGN)
    share = Share(7, buckets, 2, "127.0.0.1", 1, "run")
    assert list(share.indices(0)) == [0, 2, 4] and share.names(1) == {"w1", "w3"}
