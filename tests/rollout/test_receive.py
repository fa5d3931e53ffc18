"""The receiving side of the collective transfer without vLLM (components/rollout/vllm_worker.py `receive_into`,
transfer.py `receive_buckets`): real gloo pair groups between the trainer's `Sender` (a thread of this process) and a
server's side, a loader that stands for vLLM's `model.load_weights`, and buffers counted through the allocator the
receive uses (weak references to their storages: a buffer is alive while it, or any view of it, is)."""

import asyncio
import threading
import time
import weakref

import pytest
import torch

from components import faults
from components.rollout.client import EngineClient, EngineError
from components.rollout.transfer import (
    ALIGN,
    ReceiveRequest,
    join_group,
    joined_key,
    pack,
    plan_buckets,
    ready_key,
)
from components.rollout.vllm_worker import receive_into
from tests.rollout.test_transfer import TIMEOUT_S, _Pair, bucket_faults  # noqa: F401  (the fixture)

BUCKET_BYTES = 4096


def _weights() -> dict[str, torch.Tensor]:
    """30 tensors of 1000-1029 fp32 values (4000-4116 bytes): a bucket of 4096 bytes holds at most one, so 30 buckets."""
    gen = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(1000 + i, generator=gen) for i in range(30)}


def _body(pair: _Pair, buckets, version: int = 1) -> ReceiveRequest:
    wire = [(size, [[name, dtype, list(shape)] for name, dtype, shape in specs]) for size, specs in buckets]
    return ReceiveRequest(group=pair.request.group, version=version, buckets=wire)


class _CountedBuffers:
    """The receive's allocator, counting its buffers alive (the buffer or any view of it) at every allocation and
    every call of the loader."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.peak = 0

    def __call__(self, size: int) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.uint8)
        self.refs.append(weakref.ref(buffer.untyped_storage()))
        self.count()
        return buffer

    def count(self) -> int:
        alive = sum(ref() is not None for ref in self.refs)
        self.peak = max(self.peak, alive)
        return alive


def test_every_bucket_is_loaded_as_it_arrives_with_at_most_two_buffers_alive():
    weights = _weights()
    buckets = plan_buckets(weights, BUCKET_BYTES)
    assert len(buckets) == 30  # one tensor a bucket: 30 buffers allocated in turn
    pair = _Pair()
    buffers = [pack(weights, bucket, torch.device("cpu")) for bucket in buckets]
    allocate, calls = _CountedBuffers(), []

    def load_weights(pairs) -> None:  # a model's load_weights: copies the values, keeps no tensor
        calls.append({name: tensor.clone() for name, tensor in pairs})
        allocate.count()

    sender = pair.send_when_ready(buffers)
    answer = receive_into(pair.held, _body(pair, buckets), load_weights, allocate=allocate)
    sender.join()

    sizes = [size for size, _ in buckets]
    # every tensor at its 16-byte aligned offset: 4000-4116 bytes round up to 4000-4128, each bucket one tensor
    assert sizes == [-(-4 * (1000 + i) // ALIGN) * ALIGN for i in range(30)]
    assert answer == {"bytes": sum(sizes), "tensors": 30}
    assert pair.sent["result"] == sum(sizes)
    assert len(allocate.refs) == 30
    # bucket k+1 is posted before bucket k is loaded, and bucket k's buffer is dropped once loaded: two at most
    assert allocate.peak == 2
    assert allocate.count() == 0  # none kept after the receive
    assert [list(call) for call in calls] == [[f"layers.{i}.weight"] for i in range(30)]  # one call a bucket, in order
    for i, call in enumerate(calls):
        assert torch.equal(call[f"layers.{i}.weight"], weights[f"layers.{i}.weight"]), i


def test_a_loader_that_keeps_tensors_across_buckets_still_sees_their_values():
    """vLLM's layerwise reload keeps a layer's tensors until its last one arrives: here each "layer" is three buckets,
    whose tensors are read only once the third has come. A receive that reused two buffers would have overwritten
    the first by then; buffers are freed only once nothing refers to them."""
    weights = _weights()
    buckets = plan_buckets(weights, BUCKET_BYTES)
    pair = _Pair()
    buffers = [pack(weights, bucket, torch.device("cpu")) for bucket in buckets]
    allocate, kept, layers, alive = _CountedBuffers(), [], [], []

    def load_weights(pairs) -> None:
        kept.extend(pairs)  # views into the received buffers
        if len(kept) == 3:
            alive.append(allocate.count())
            layers.append({name: tensor.clone() for name, tensor in kept})
            kept.clear()

    sender = pair.send_when_ready(buffers)
    answer = receive_into(pair.held, _body(pair, buckets), load_weights, allocate=allocate)
    sender.join()

    assert answer["tensors"] == 30 and len(layers) == 10
    # when a layer completes: its three buffers, and the next bucket's, posted before this one was loaded
    assert alive == [4] * 9 + [3]  # the last layer has no next bucket
    for layer in layers:
        for name, tensor in layer.items():
            assert torch.equal(tensor, weights[name]), name


def test_a_transfer_broken_after_the_first_buckets_reports_the_weights_changed(bucket_faults):  # noqa: F811
    weights = _weights()
    buckets = plan_buckets(weights, BUCKET_BYTES)
    pair = _Pair()
    buffers = [pack(weights, bucket, torch.device("cpu")) for bucket in buckets]
    loaded: list[str] = []
    bucket_faults("weights.bucket@5:raise")  # the trainer breaks off once it has posted its 5th bucket

    sender = pair.send_when_ready(buffers)
    began = time.monotonic()
    answer = receive_into(pair.held, _body(pair, buckets), lambda pairs: loaded.extend(n for n, _ in pairs))
    took = time.monotonic() - began
    sender.join()

    assert isinstance(pair.sent["result"], faults.InjectedFault)
    # the 5 buckets the trainer posted (the last two in flight when it broke off) reached the model, then nothing:
    # its weights are a mix of two versions, and the answer says so (the trainer retries; its client holds
    # requests to the server meanwhile)
    assert loaded == [f"layers.{i}.weight" for i in range(5)]
    assert answer["status"] == 500 and answer["param"] == "group" and answer["weights_unchanged"] is False
    assert answer["error"].startswith("group: ")
    assert took < TIMEOUT_S + 1.0  # the receive ends when the trainer's group closes, or at its timeout


def test_a_transfer_that_never_starts_reports_the_weights_unchanged():
    weights = _weights()
    buckets = plan_buckets(weights, BUCKET_BYTES)
    pair = _Pair(timeout_s=1.0)
    loaded: list[str] = []
    began = time.monotonic()
    answer = receive_into(pair.held, _body(pair, buckets), lambda pairs: loaded.extend(n for n, _ in pairs))
    took = time.monotonic() - began  # nobody sends: the first bucket's timeout
    assert loaded == []
    assert answer["status"] == 500 and answer["weights_unchanged"] is True
    assert answer["error"].startswith("group: bucket 1 of 30: ")
    assert 0.9 < took < 2.5


def test_a_bucket_the_loader_refuses_is_reported_after_the_rest_are_drained():
    weights = _weights()
    buckets = plan_buckets(weights, BUCKET_BYTES)
    pair = _Pair()
    buffers = [pack(weights, bucket, torch.device("cpu")) for bucket in buckets]
    loaded: list[str] = []

    def load_weights(pairs) -> None:
        for name, _ in pairs:
            if name == "layers.3.weight":
                raise ValueError(f"{name} is not a parameter of this model")
            loaded.append(name)

    sender = pair.send_when_ready(buffers)
    answer = receive_into(pair.held, _body(pair, buckets), load_weights)
    sender.join()

    assert pair.sent["result"] == sum(size for size, _ in buckets)  # the trainer's broadcast ended: all drained
    assert loaded == [f"layers.{i}.weight" for i in range(3)]  # nothing reaches the model after the refusal
    assert answer == {
        "error": "tensors: layers.3.weight is not a parameter of this model",
        "param": "tensors",
        "status": 400,
        "weights_unchanged": False,
    }


def test_a_bucket_whose_tensors_do_not_fill_it_is_refused_before_the_ready_key():
    pair = _Pair()
    body = ReceiveRequest(group=pair.request.group, version=1, buckets=[(16, [["a", "float32", [3]]]), (8, [])])
    answer = receive_into(pair.held, body, lambda pairs: None)
    assert answer == {
        "error": "buckets: bucket 1: the tensors take 0 bytes, the bucket has 8",
        "param": "buckets",
        "status": 400,
        "weights_unchanged": True,
    }
    assert not pair.sender.arrived(ready_key(pair.request.group, 1))  # the trainer was never told to broadcast


def test_every_worker_of_a_tensor_parallel_server_receives_every_bucket_from_one_broadcast():
    """A vLLM with tensor parallelism joins from each of its workers (vllm_worker.py `sao_join_group`): the group is
    the sender and both workers, the sender reads their count from the joined key, and one broadcast of each bucket
    reaches both, each handing every tensor to its own loader (vLLM's `load_weights` keeps the worker's shard)."""
    weights = _weights()
    buckets = plan_buckets(weights, BUCKET_BYTES)
    pair = _Pair(workers=2)
    buffers = [pack(weights, bucket, torch.device("cpu")) for bucket in buckets]
    loaded: list[dict[str, torch.Tensor]] = [{}, {}]
    answers: dict[int, dict] = {}

    def worker(rank: int) -> None:
        load = lambda pairs: loaded[rank].update((name, tensor.clone()) for name, tensor in pairs)  # noqa: E731
        answers[rank] = receive_into(pair.helds[rank], _body(pair, buckets), load)

    workers = [threading.Thread(target=worker, args=(rank,)) for rank in (0, 1)]
    for thread in workers:
        thread.start()
    sender = pair.send_when_ready(buffers)
    for thread in workers + [sender]:
        thread.join()

    assert pair.receivers == 2
    size = sum(size for size, _ in buckets)
    assert answers == {0: {"bytes": size, "tensors": 30}, 1: {"bytes": size, "tensors": 30}}
    assert pair.sent["result"] == size  # sent once: the broadcast reaches both workers
    for rank in (0, 1):
        assert list(loaded[rank]) == list(weights), rank
        assert all(torch.equal(loaded[rank][name], weights[name]) for name in weights), rank


def test_a_worker_outside_the_servers_or_a_bad_worker_count_is_refused_by_name():
    pair = _Pair()
    with pytest.raises(ValueError, match=r"worker: expected 0 <= worker < 2, got 2"):
        join_group(pair.request, worker=2, workers=2)
    pair.held.store.set(joined_key("other"), "none")
    with pytest.raises(ValueError, match=r"other/joined: expected the server's worker count, got 'none'"):
        pair.sender.receivers("other")


def test_a_tensor_parallel_server_one_of_whose_workers_loaded_is_never_reported_unchanged(serve):
    """`collective_rpc` answers one result per worker. Where one worker refused before loading (weights unchanged)
    and the other loaded its shard, the server holds a mix of versions: the client's error says the weights changed,
    so its gate holds requests until an update succeeds. A join refused by one worker changed nothing. (A stand-in
    for vLLM's route, as no real vLLM worker can be made to fail alone here; `make test-vllm` runs a real TP=2
    server's transfers.)"""
    from fastapi import FastAPI  # the stand-in's app: tests only

    app = FastAPI()
    refusal = {"error": "group: bucket 1 of 3: broke", "param": "group", "status": 500, "weights_unchanged": True}

    @app.post("/collective_rpc")
    async def rpc(body: dict) -> dict:
        return {"results": [{"bytes": 10, "tensors": 1}, refusal]}

    @app.post("/reset_prefix_cache")
    async def reset() -> dict:
        return {"success": True}

    server = serve(app)

    async def run(call, body) -> EngineError:
        async with EngineClient(server.url, backend="vllm", retries=0) as client:
            with pytest.raises(EngineError) as raised:
                await getattr(client, call)(body)
        return raised.value

    received = asyncio.run(run("receive_weights", {"group": "g", "version": 1}))
    joined = asyncio.run(run("join_group", {"group": "g"}))
    assert (received.status, received.weights_unchanged) == (500, False)
    assert str(received).endswith("group: bucket 1 of 3: broke")
    assert (joined.status, joined.weights_unchanged) == (500, True)
