"""The collective weight transport and the weights probe against real servers: buckets over real gloo groups
between this process (the trainer) and `sao engine serve` (in this process on uvicorn threads, or a child
process to SIGKILL), and a test double that drops the new tensors, which the probe must catch. Then the trainer's
`Sender` against a server's side that stalls: the whole transfer ends at `rollout.transfer_timeout_s`, or at once
when the server's call fails."""

import asyncio
import threading
import time

import httpx
import pytest
import torch

from components.rollout.backends import HttpRollouts
from components.rollout.engine_process import EngineProcess
from components.rollout.pairs import broadcast
from components.rollout.probe import WeightsMismatch
from components.rollout.transfer import (
    ALIGN,
    Sender,
    join_group,
    joined_key,
    pack,
    plan_buckets,
    ready_key,
    unpack,
)
from components.rollout.transports import FilesystemTransport
from tests.conftest import child_env
from tests.rollout.test_backends import _config, _request, _teacher_forced, _version, _weights


def test_buckets_pack_at_aligned_offsets_and_unpack_to_the_same_tensors():
    weights = {
        "a": torch.arange(3, dtype=torch.float32),  # 12 bytes -> 16
        "b": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),  # 12 bytes -> 16
        "c": torch.arange(5, dtype=torch.int64),  # 40 bytes -> 48
        "d": torch.ones(2, 2),  # 16 bytes
    }
    buckets = plan_buckets(weights, bucket_bytes=40)
    # a + b fill 32 bytes; c (48) would pass 40, so it opens a bucket of its own, which it overflows alone; d follows.
    assert [(size, [spec[0] for spec in specs]) for size, specs in buckets] == [
        (32, ["a", "b"]),
        (48, ["c"]),
        (16, ["d"]),
    ]
    assert buckets[0][1][1] == ("b", "bfloat16", (2, 3))
    out = {}
    for bucket in buckets:
        buffer = pack(weights, bucket, torch.device("cpu"))
        assert buffer.dtype == torch.uint8 and buffer.numel() % ALIGN == 0
        out.update(unpack(buffer, bucket[1]))
    for name, tensor in weights.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(weights, 0)
    with pytest.raises(ValueError, match="bucket has 32"):
        unpack(torch.zeros(32, dtype=torch.uint8), [("a", "float32", (3,))])


def _rollouts(urls, model, tokenizer, publish_dir, log=print, revive_after_s=2.0, **fields) -> HttpRollouts:
    """`HttpRollouts` over the collective transport, the weights probe after every version; `fields` of the section."""
    settings = {"weight_transfer": "collective", "probe_every": 1, "transfer_timeout_s": 20.0, **fields}
    return HttpRollouts(
        _config(urls, **settings), model, tokenizer, publish_dir, log=log, revive_after_s=revive_after_s
    )


def test_collective_transfer_reaches_both_servers_without_a_file_and_the_probe_agrees(tiny, serve, tmp_path):
    model, tokenizer = tiny
    a, b = serve(model, tokenizer), serve(model, tokenizer)
    versions = {v: _version(model, seed=v) for v in (1, 2)}
    publish_dir = tmp_path / "published"

    async def run():
        rollouts = _rollouts([a.url, b.url], model, tokenizer, publish_dir)
        await rollouts.start()
        seen = []
        for v, weights in versions.items():
            await rollouts.publish(_weights(weights), v)
            seen.append([httpx.get(f"{s.url}/health").json() for s in (a, b)])
        result = await rollouts.engine.generate(_request(tokenizer, 3))
        metrics = rollouts.metrics()
        await rollouts.close()
        return seen, result, metrics

    seen, result, metrics = asyncio.run(run())
    for v, health in zip((1, 2), seen):
        assert [h["version"] for h in health] == [v, v]
        assert {h["path"] for h in health} == {str((publish_dir / f"v{v:08d}").resolve())}  # a label only
        assert all(h["transfer_group"] for h in health)
    assert not publish_dir.exists()  # no version was written
    assert result.versions == [2] * 8
    torch.testing.assert_close(torch.tensor(result.logprobs), _teacher_forced(versions[2], result), atol=1e-5, rtol=0)
    assert (
        metrics["rollout/probe_failures"] == 0
        and metrics["rollout/probe_median_abs_diff"] < 1e-5
        and metrics["rollout/probe_max_abs_diff"] < 1e-4
    )
    assert metrics["rollout/transfer_fallbacks"] == 0 and metrics["rollout/transfer_retries"] == 0
    # each server gets every tensor once (a tied one under one name), each at a 16-byte aligned offset
    unique = {
        n: t for n, t in model.state_dict().items() if n != "lm_head.weight" or not model.config.tie_word_embeddings
    }
    per_version = sum(size for size, _ in plan_buckets(unique, 2**29))
    assert metrics["rollout/publish_bytes"] == 2 * per_version  # v2, to both servers
    assert metrics["rollout/transfer_s"] > 0


class _DroppingTransport(FilesystemTransport):
    """A transport that drops the new tensors: every version goes out as the weights it held when built, under the
    new version number, so the HTTP calls succeed and `/health` reports the version."""

    def __init__(self, template, tokenizer, publish_dir) -> None:
        super().__init__(template, tokenizer, publish_dir)
        self.stale, _ = super().stage(dict(template.state_dict()), 0)

    def stage(self, weights, version: int):
        return self.stale, weights

    async def load(self, client, label, version, rewind):
        await client.publish_weights(label, version, True)


def test_a_transport_that_drops_the_tensors_is_caught_by_the_probe(tiny, serve, tmp_path):
    model, tokenizer = tiny
    a, b = serve(model, tokenizer), serve(model, tokenizer)
    lines = []

    async def run():
        rc = _config([a.url, b.url], probe_every=1)
        rollouts = HttpRollouts(rc, model, tokenizer, tmp_path / "p", log=lines.append)
        await rollouts.start()  # v0 is what the servers hold: the probe agrees
        assert rollouts.engine.live() == 2
        rollouts.transport = _DroppingTransport(rollouts._template, tokenizer, tmp_path / "p")  # holds v0 now
        with pytest.raises(WeightsMismatch, match="every engine server failed the weights probe") as caught:
            await rollouts.publish(_weights(_version(model, seed=1)), 1)
        served = [httpx.get(f"{s.url}/health").json()["version"] for s in (a, b)]
        metrics = rollouts.metrics()
        await rollouts.close()
        return caught.value, served, metrics

    error, served, metrics = asyncio.run(run())
    assert served == [1, 1]  # both said they took v1
    assert a.url in str(error) and b.url in str(error) and "differ from the trainer's" in str(error)
    assert metrics["rollout/probe_failures"] == 2 and metrics["rollout/engines_live"] == 0
    assert len(lines) == 2 and all("taken out of the pool" in line for line in lines)


def test_a_restarted_server_gets_the_current_weights_through_a_new_group_before_its_first_request(
    sft_dir, sft_policy, tmp_path
):
    model, tokenizer = sft_policy
    engine = EngineProcess(sft_dir, threads=1, env=child_env()).start()
    v1 = _version(model, seed=1)
    try:

        async def run():
            rollouts = _rollouts([engine.url], model, tokenizer, tmp_path / "p", revive_after_s=0.2, request_retries=0)
            await rollouts.start()
            before = engine.health()["transfer_group"]
            await rollouts.publish(_weights(v1), 1)
            engine.kill()
            engine.start()  # the same port, its starting (SFT) weights, version 0, no group
            restarted = engine.health()
            result = await rollouts.engine.generate(_request(tokenizer, 5))  # fails, revives, answers
            after = engine.health()
            metrics = rollouts.metrics()
            await rollouts.close()
            return before, restarted, result, after, metrics

        before, restarted, result, after, metrics = asyncio.run(run())
    finally:
        engine.kill()
    assert (restarted["version"], restarted["transfer_group"]) == (0, None)
    assert after["version"] == 1 and after["transfer_group"] not in (None, before)
    assert result.versions == [1] * 8  # its first request after the restart sampled v1
    torch.testing.assert_close(torch.tensor(result.logprobs), _teacher_forced(v1, result), atol=1e-5, rtol=0)
    assert metrics["rollout/engine_errors"] >= 1 and metrics["rollout/transfer_fallbacks"] == 0


def test_an_overlapped_publish_returns_staged_and_the_next_one_waits_for_it(tiny, serve, tmp_path):
    model, tokenizer = tiny
    a, b = serve(model, tokenizer), serve(model, tokenizer)
    versions = {v: _version(model, seed=v) for v in (1, 2, 3)}

    async def run():
        rollouts = _rollouts([a.url, b.url], model, tokenizer, tmp_path / "p", publish_overlap=True)
        await rollouts.start()
        await rollouts.publish(_weights(versions[1]), 1)
        # publish returned without awaiting the transfer: nothing has run since, and this blocking call lets
        # nothing run either, so both servers still serve v0
        staged = [httpx.get(f"{s.url}/health").json()["version"] for s in (a, b)]
        await rollouts.settle()
        settled = [httpx.get(f"{s.url}/health").json()["version"] for s in (a, b)]
        await rollouts.publish(_weights(versions[2]), 2)
        await rollouts.publish(_weights(versions[3]), 3)  # waits for v2's transfer (and probe) first
        await rollouts.close()  # waits for v3's
        ended = [httpx.get(f"{s.url}/health").json()["version"] for s in (a, b)]
        return staged, settled, ended, rollouts.metrics()

    staged, settled, ended, metrics = asyncio.run(run())
    assert (staged, settled, ended) == ([0, 0], [1, 1], [3, 3])
    assert (
        metrics["rollout/probe_failures"] == 0
        and metrics["rollout/probe_median_abs_diff"] < 1e-5
        and metrics["rollout/probe_max_abs_diff"] < 1e-4
    )


def test_an_overlapped_transfer_that_fails_raises_at_the_next_settle(tiny, serve, tmp_path):
    model, tokenizer = tiny
    a = serve(model, tokenizer)

    async def run():
        rc = _config([a.url], probe_every=1, publish_overlap=True)
        rollouts = HttpRollouts(rc, model, tokenizer, tmp_path / "p")
        await rollouts.start()
        rollouts.transport = _DroppingTransport(rollouts._template, tokenizer, tmp_path / "p")  # holds v0 now
        await rollouts.publish(_weights(_version(model, seed=1)), 1)  # staged: the failure is still to come
        with pytest.raises(WeightsMismatch, match=a.url):
            await rollouts.settle()
        await rollouts.close()  # nothing pending any more: closes cleanly

    asyncio.run(run())


@pytest.fixture
def bucket_faults(monkeypatch):
    """`bucket_faults(spec)`: arm the trainer-side fault point `weights.bucket` in this process (`SAO_FAULTS` syntax)."""
    from components import faults

    def arm(spec: str | None) -> None:
        monkeypatch.setattr(faults, "_faults", faults.parse_faults(spec or ""))
        monkeypatch.setattr(faults, "_hits", {})

    return arm


def test_a_transfer_broken_mid_way_is_retried_on_a_new_group(tiny, serve, tmp_path, bucket_faults):
    model, tokenizer = tiny
    a = serve(model, tokenizer)
    v1 = _version(model, seed=1)
    lines = []

    async def run():
        # 1 MB buckets: the tiny model's weights take several, and the first transfer of v1 breaks after its second.
        # The server notices only at its timeout (both processes live on; gloo cannot interrupt its receive).
        rollouts = _rollouts(
            [a.url], model, tokenizer, tmp_path / "p", log=lines.append, transfer_timeout_s=3.0, transfer_bucket_mb=1
        )
        await rollouts.start()
        group = httpx.get(f"{a.url}/health").json()["transfer_group"]
        buckets = len(rollouts.transport._staged[0][1])
        bucket_faults("weights.bucket@2:raise")
        await rollouts.publish(_weights(v1), 1)
        health = httpx.get(f"{a.url}/health").json()
        metrics = rollouts.metrics()
        await rollouts.close()
        return group, buckets, health, metrics

    group, buckets, health, metrics = asyncio.run(run())
    assert buckets >= 3
    assert health["version"] == 1 and health["transfer_group"] != group  # loaded, through a group formed anew
    assert (metrics["rollout/transfer_retries"], metrics["rollout/transfer_fallbacks"]) == (1.0, 0.0)
    assert (
        metrics["rollout/probe_failures"] == 0
        and metrics["rollout/probe_median_abs_diff"] < 1e-5
        and metrics["rollout/probe_max_abs_diff"] < 1e-4
    )
    assert not (tmp_path / "p").exists() and not any("filesystem" in line for line in lines)


def test_a_transfer_that_fails_twice_goes_through_the_filesystem_then_collective_again(
    tiny, serve, tmp_path, bucket_faults
):
    model, tokenizer = tiny
    a = serve(model, tokenizer)
    v1, v2 = _version(model, seed=1), _version(model, seed=2)
    lines = []

    async def run():
        rollouts = _rollouts(
            [a.url], model, tokenizer, tmp_path / "p", log=lines.append, transfer_timeout_s=3.0, transfer_bucket_mb=1
        )
        await rollouts.start()
        bucket_faults("weights.bucket@1+:raise")  # every collective transfer breaks after its first bucket
        await rollouts.publish(_weights(v1), 1)
        after_v1 = (
            httpx.get(f"{a.url}/health").json(),
            rollouts.metrics(),
            sorted(p.name for p in (tmp_path / "p").iterdir()),
        )
        bucket_faults(None)
        await rollouts.publish(_weights(v2), 2)
        after_v2 = httpx.get(f"{a.url}/health").json(), rollouts.metrics()
        await rollouts.close()
        return after_v1, after_v2

    (health1, metrics1, written), (health2, metrics2) = asyncio.run(run())
    # v1: two broken transfers (the second on a new group), then the directory the server read
    assert health1["version"] == 1 and health1["path"] == str((tmp_path / "p" / "v00000001").resolve())
    assert written == ["v00000001"]
    assert (metrics1["rollout/transfer_retries"], metrics1["rollout/transfer_fallbacks"]) == (1.0, 1.0)
    assert (
        metrics1["rollout/probe_failures"] == 0
        and metrics1["rollout/probe_median_abs_diff"] < 1e-5
        and metrics1["rollout/probe_max_abs_diff"] < 1e-4
    )
    assert len(lines) == 2 and "failed twice" in lines[1] and "filesystem path" in lines[1]
    # v2: the collective path again, on a new group; nothing more written or counted
    assert health2["version"] == 2 and health2["transfer_group"] not in (None, health1["transfer_group"])
    assert (metrics2["rollout/transfer_retries"], metrics2["rollout/transfer_fallbacks"]) == (1.0, 1.0)
    assert metrics2["rollout/probe_median_abs_diff"] < 1e-5 and metrics2["rollout/probe_max_abs_diff"] < 1e-4


TIMEOUT_S = 2.0


class _Pair:
    """A trainer-side `Sender` and a server's side (`join_group`) of one gloo group, formed in this process: the
    server has `workers` workers (a vLLM with tensor parallelism), each joining from a thread of its own; `helds`
    are their sides, `held` the first's. The sender forms with as many as the server's joined key says."""

    def __init__(self, timeout_s: float = TIMEOUT_S, workers: int = 1) -> None:
        self.sender = Sender("127.0.0.1", timeout_s)
        self.request = self.sender.request("server")
        joined: dict[int, object] = {}
        threads = [
            threading.Thread(target=lambda w=w: joined.update({w: join_group(self.request, w, workers)}))
            for w in range(workers)
        ]
        for thread in threads:
            thread.start()
        while not self.sender.arrived(joined_key(self.request.group)):
            time.sleep(0.001)
        self.receivers = self.sender.receivers(self.request.group)
        self.sender.form("server", self.request, self.receivers)
        for thread in threads:
            thread.join()
        self.helds = [joined[w] for w in range(workers)]
        self.held = self.helds[0]
        self.sent: dict = {}

    def send_when_ready(self, buffers, version: int = 1) -> threading.Thread:
        """Send `buffers` from a thread once the server has set its ready key, as the trainer does; the outcome (bytes
        or the exception) goes to `self.sent["result"]`."""

        def run() -> None:
            deadline = time.monotonic() + 10
            while not self.sender.arrived(ready_key(self.request.group, version)):
                if time.monotonic() > deadline:
                    self.sent["result"] = TimeoutError("no ready key")
                    return
                time.sleep(0.001)
            try:
                self.sent["result"] = self.sender.send("server", buffers)
            except Exception as exc:
                self.sent["result"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        return thread


class _StallingServer(threading.Thread):
    """A server's side of a pair group that receives `count` buckets of `size` bytes in turn, `pause_s` before each,
    and after `stops_after` of them stops receiving while it holds its group, as a stalled process would, until
    `release` is set."""

    def __init__(self, held, count: int, size: int, pause_s: float = 0.0, stops_after: int | None = None) -> None:
        super().__init__(daemon=True)
        self.held, self.count, self.size, self.pause_s, self.stops_after = held, count, size, pause_s, stops_after
        self.received = 0
        self.release = threading.Event()

    def run(self) -> None:
        for index in range(self.count):
            if index == self.stops_after:
                self.release.wait(30)
                return
            time.sleep(self.pause_s)
            try:
                broadcast(self.held.group, torch.empty(self.size, dtype=torch.uint8), 10.0)
            except (RuntimeError, OSError):  # the trainer's side gave up: `received` tells how far it came
                return
            self.received += 1


def test_a_server_that_stops_receiving_mid_transfer_fails_the_send_within_its_timeout():
    pair = _Pair(timeout_s=2.0)
    server = _StallingServer(pair.held, count=10, size=4096, stops_after=3)
    server.start()
    began = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError)):
        pair.sender.send("server", [torch.zeros(4096, dtype=torch.uint8) for _ in range(10)])
    took = time.monotonic() - began
    server.release.set()
    server.join(5)
    # gloo's send waits for the receiver: bucket 4 never completes, and the transfer's deadline ends it at 2 s
    assert server.received == 3
    assert 1.9 < took < 3.0
    assert pair.sender.group_id("server") is None  # dropped: the next transfer forms a new group (and retries)


def test_a_transfer_slower_than_its_timeout_fails_at_the_deadline_not_bucket_by_bucket():
    pair = _Pair(timeout_s=2.0)
    server = _StallingServer(pair.held, count=10, size=4096, pause_s=0.5)
    server.start()
    began = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError)):
        pair.sender.send("server", [torch.zeros(4096, dtype=torch.uint8) for _ in range(10)])
    took = time.monotonic() - began
    server.join(5)
    # Each bucket arrives 0.5 s after the one before, well inside a 2 s timeout per operation: bucket by bucket the
    # transfer would take 10 x 0.5 = 5 s and succeed. `rollout.transfer_timeout_s` bounds the whole transfer, so it
    # ends at 2 s, after the buckets received at 0.5, 1.0 and 1.5 s (a fourth one at 2.0 s races the deadline).
    assert server.received in (3, 4)
    assert 1.9 < took < 3.0


def test_a_send_abandoned_by_the_servers_call_stops_at_once():
    """The trainer's HTTP call to the server fails (the transport sets `abandon`): the broadcast stops then, not at
    the transfer's deadline."""
    pair = _Pair(timeout_s=5.0)
    server = _StallingServer(pair.held, count=10, size=4096, stops_after=2)
    server.start()
    abandon = threading.Event()
    threading.Timer(0.5, abandon.set).start()
    began = time.monotonic()
    with pytest.raises(ConnectionError, match="abandoned"):
        pair.sender.send("server", [torch.zeros(4096, dtype=torch.uint8) for _ in range(10)], abandon)
    took = time.monotonic() - began
    server.release.set()
    server.join(5)
    assert server.received == 2
    assert 0.45 < took < 1.5  # not the 5 s deadline
    assert pair.sender.group_id("server") is None
