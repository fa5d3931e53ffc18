"""The collective weight transport: checkpoint-named tensors in buckets, broadcast from the trainer to a server over
a process group, with no file written (`rollout.weight_transfer = "collective"`).

Each server gets a group of its own with the trainer's sending rank (rank 0, which hosts the rendezvous store) and
the server's workers (ranks 1..W: `sao engine serve` is one; a vLLM with tensor or pipeline parallelism joins from
each of its W workers, says W in its joined key, and each worker receives every bucket, one broadcast reaching them
all, and loads its own shard of it): gloo on CPU, NCCL where the server's model is on a GPU. A group per server
means a server that restarts or joins forms its own without touching the others, and a dead peer is
seen at once (gloo: "connection closed by peer"). Two routes of `sao engine serve`, both behind the weights
token (components/rollout/access.py):

1. `POST /v1/weights/group {"group", "address", "port", "backend", "timeout_s"}`: the server joins the group
   whose store listens at address:port; the call returns once both sides have formed it, so the trainer forms
   its side at the same time. `/health` reports the group the server holds (`transfer_group`): one that
   differs from the trainer's (a restarted server holds none) is formed again before the next transfer.
2. `POST /v1/weights/receive {"group", "version", "rewind", "path", "buckets"}`: `buckets` lists, per bucket,
   its size in bytes and the `[name, dtype, shape]` of each tensor in it. The server checks that list first (a
   bucket whose tensors do not fill it is refused before anything is broadcast), then receives every bucket
   (always all of them, into scratch if it then refuses the update, so the trainer's broadcast never hangs on
   a refusal), views the tensors out of it, and loads them into the engine between decode steps as `version`;
   `path` is only the label `/health` reports (`publish_dir/v{version:08d}`, never written), so a resumed
   trainer tells its own versions from another run's as it does for the filesystem path.

Tensors are laid out in a bucket at 16-byte aligned offsets, so every one is viewed, not copied, out of it.

Every collective is completed on the host against a deadline (components/rollout/pairs.py). The sender
(`Sender.send`) finishes a transfer within `rollout.transfer_timeout_s` with at most `IN_FLIGHT` buckets posted
and not completed; under NCCL each is copied from pinned host memory to the GPU on a CUDA stream of the transfer's
own, never on the stream training runs on. The receiver (`receive_buckets`) takes each bucket into a buffer of its
own and posts the next before loading the current one: two buffers are alive, plus those whose tensors the loader
keeps. No buffer is recycled by hand: vLLM's layerwise reload keeps the tensors of a layer that spans buckets until
its last one has come (`online_process_loader`, vllm/model_executor/model_loader/reload/layerwise.py), and a reused
buffer would overwrite them.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed import TCPStore

from components.faults import fault_point
from components.rollout.pairs import abort, complete, is_nccl, pair_group, post, release_when_done

ALIGN = 16
"""Byte alignment of each tensor in a bucket (any dtype can be viewed at it)."""
CPU = torch.device("cpu")
IN_FLIGHT = 2
"""Buckets a sender posts before it completes the oldest: one on the wire while the next is copied to the GPU."""
Spec = tuple[str, str, tuple[int, ...]]
"""(name, dtype name as torch spells it without `torch.`, shape) of one tensor."""
Bucket = tuple[int, list[Spec]]
"""(size in bytes, the specs of its tensors in their order) of one bucket."""


class GroupMismatch(ValueError):
    """A transfer names a group the server does not hold (it restarted, or formed a newer one): form it again.
    The server answers 409, before any bucket is broadcast."""


class GroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group: str = Field(min_length=1)
    address: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    backend: str = "gloo"
    timeout_s: float = Field(60.0, gt=0)
    senders: int = Field(1, ge=1)
    """The trainer's ranks that send (components/rollout/senders.py): the server forms a pair group with each."""


class ReceiveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group: str = Field(min_length=1)
    version: int = Field(ge=0)
    rewind: bool = False
    path: str | None = None
    """What `/health` reports as the weights' path once loaded (a label: nothing is read from it)."""
    drain: bool = False
    """Load once the sequences in flight have finished (`rollout.update_mode = "drain"`)."""
    senders: int = Field(1, ge=1)
    """Bucket i comes from sender i mod `senders`, over the held group's member of that index (at most the members
    it holds: a version the trainer's other ranks did not stage comes from rank 0 alone)."""
    buckets: list[tuple[int, list[tuple[str, str, list[int]]]]]


# ---- buckets ------------------------------------------------------------------------------------------------


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return -(-n // ALIGN) * ALIGN


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"buckets: unknown dtype {name!r}")
    return dtype


def plan_buckets(weights: dict[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Split `weights` (in their order) into buckets of at most `bucket_bytes` (a larger tensor is a bucket of its
    own): per bucket, its size in bytes and the specs of its tensors."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
    buckets: list[Bucket] = []
    size, specs = 0, []
    for name, tensor in weights.items():
        n = _nbytes(tensor.dtype, tensor.shape)
        if specs and size + n > bucket_bytes:
            buckets.append((size, specs))
            size, specs = 0, []
        specs.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
        size += n
    if specs:
        buckets.append((size, specs))
    return buckets


def pack(weights: dict[str, torch.Tensor], bucket: Bucket, device: torch.device, pinned: bool = False) -> torch.Tensor:
    """The bytes of one bucket's tensors, each at its aligned offset, as one uint8 tensor on `device` (in pinned
    host memory with `pinned`; the padding between them is left as allocated: nobody reads it)."""
    size, specs = bucket
    buffer = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pinned)
    offset = 0
    for name, _, _ in specs:
        flat = weights[name].detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + flat.numel()].copy_(flat)
        offset += _nbytes(weights[name].dtype, weights[name].shape)
    return buffer


def unpack(buffer: torch.Tensor, specs: list[Spec]) -> dict[str, torch.Tensor]:
    """The tensors of one received bucket, viewed out of `buffer` (no copy)."""
    out, offset = {}, 0
    for name, dtype_name, shape in specs:
        dtype = dtype_of(dtype_name)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out[name] = buffer[offset : offset + n].view(dtype).reshape(shape)
        offset += _nbytes(dtype, shape)
    if offset != buffer.numel():
        raise ValueError(f"buckets: the tensors take {offset} bytes, the bucket has {buffer.numel()}")
    return out


def bucket_layout(buckets: list) -> list[Bucket]:
    """A receive request's `buckets` as (size, specs), checked before anything is broadcast: every dtype known, and
    the tensors at their aligned offsets filling the bucket exactly; ValueError naming the bucket."""
    out: list[Bucket] = []
    for index, (size, specs) in enumerate(buckets):
        specs = [(name, dtype_name, tuple(shape)) for name, dtype_name, shape in specs]
        taken = sum(_nbytes(dtype_of(dtype_name), shape) for _, dtype_name, shape in specs)
        if taken != size:
            raise ValueError(f"buckets: bucket {index}: the tensors take {taken} bytes, the bucket has {size}")
        out.append((size, specs))
    return out


# ---- the groups -------------------------------------------------------------------------------------------


@dataclass
class Held:
    """One side's transfer group: its id, its pair groups (a server holds one per sender of the trainer's; a sender
    its own), the store it was formed over, its timeout."""

    id: str
    groups: list
    store: object = None
    timeout_s: float = 60.0

    @property
    def group(self):
        """The first pair group (the only one where one rank sends)."""
        return self.groups[0]

    def device(self, gpu: torch.device) -> torch.device:
        """Where this side receives its buckets: on `gpu` over an NCCL group, else on the CPU."""
        return gpu if is_nccl(self.group) else CPU


def member(group: str, index: int, senders: int) -> str:
    """The pair group between sender `index` of `senders` and a server, within the transfer group `group`."""
    return group if senders == 1 else f"{group}.{index}"


def joined_key(group: str) -> str:
    return f"{group}/joined"


def ready_key(group: str, version: int) -> str:
    return f"{group}/ready/{version}"


def join_group(request: GroupRequest, worker: int = 0, workers: int = 1) -> Held:
    """A server's side of `request.group`, for its worker `worker` of `workers` (a vLLM with tensor or pipeline
    parallelism joins from every worker; `sao engine serve` is one): join the trainer's store, set the joined key to
    `workers` (the trainer forms its side once it is there, as a group of 1 + `workers` members), form a group with
    each of the `request.senders` senders, in their order, as rank 1 + `worker` (each once every member has).
    RuntimeError or ValueError when it cannot."""
    if not 0 <= worker < workers:
        raise ValueError(f"worker: expected 0 <= worker < {workers}, got {worker}")
    timeout = datetime.timedelta(seconds=request.timeout_s)
    store = TCPStore(request.address, request.port, None, False, timeout=timeout)
    store.set(joined_key(request.group), str(workers))
    # gloo binds this side's sockets on the interface that reaches the trainer
    host = "127.0.0.1" if request.address in ("127.0.0.1", "localhost") else _own_address(request)
    groups = [
        pair_group(
            store,
            member(request.group, index, request.senders),
            1 + worker,
            request.backend,
            host,
            request.timeout_s,
            1 + workers,
        )
        for index in range(request.senders)
    ]
    return Held(request.group, groups, store, request.timeout_s)


# ---- the receiving side -------------------------------------------------------------------------------------


class TransferBroken(RuntimeError):
    """The group failed before every bucket had arrived (the trainer broke off or died, or a bucket did not come
    within the timeout): the group is gone. `handed`: how many buckets had reached the loader by then (the last one
    perhaps refused)."""

    def __init__(self, message: str, handed: int) -> None:
        super().__init__(message)
        self.handed = handed


def receive_buckets(
    groups,
    buckets: list[Bucket],
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
    timeout_s: float,
    device: torch.device = CPU,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> int:
    """Receive `buckets` (checked by `bucket_layout`) over `groups` (one pair group, or a list: bucket i over
    `groups[i % len(groups)]`, from the sender of that index), each into a buffer of its own from `allocate(size)`
    (default: uint8 on `device`), and hand each bucket's (name, tensor) pairs, viewed out of it, to `load` once it
    has arrived, the next bucket from every sender already posted (module docstring); returns the bytes received.
    Each bucket must arrive within `timeout_s` of being awaited. When `load` raises, the rest are still received (so
    the trainer's broadcasts end) and its exception raised after them; when a group fails, every one is aborted:
    TransferBroken."""
    groups = groups if isinstance(groups, list) else [groups]
    allocate = allocate or (lambda size: torch.empty(size, dtype=torch.uint8, device=device))
    count, handed, refused, ahead = len(buckets), 0, None, 0
    posted: deque[tuple[object, object, torch.Tensor]] = deque()  # (group, work, buffer) of each bucket posted
    for index, (_, specs) in enumerate(buckets):
        current = None
        try:
            while ahead < min(index + len(groups) + 1, count):  # this one, and the next from every sender
                group, buffer = groups[ahead % len(groups)], allocate(buckets[ahead][0])
                posted.append((group, post(group, buffer), buffer))
                ahead += 1
            current = posted.popleft()
            complete(current[0], current[1], time.monotonic() + timeout_s, f"not received within {timeout_s:g} s")
        except (RuntimeError, OSError) as exc:  # a sender died, broke off or stalled: nothing more will come
            for group in groups:
                abort(group)  # NCCL: the receives posted for the next buckets end too
            waiting = [current, *posted] if current is not None else list(posted)
            for group in groups:
                release_when_done(group, [work for owner, work, _ in waiting if owner is group])
            after = f" (the loader had refused bucket {handed}: {refused})" if refused is not None else ""
            raise TransferBroken(f"bucket {index + 1} of {count}: {exc}{after}", handed) from exc
        if refused is None:
            handed += 1
            try:
                load(iter(unpack(current[2], specs).items()))
            except Exception as exc:  # raised once the rest are drained, by whoever called this
                refused = exc
        current = None  # this bucket's buffer is free now, unless `load` keeps its tensors
    if refused is not None:
        raise refused
    return sum(size for size, _ in buckets)


class Receiver:
    """A server's side: the group it holds and the transfers over it, one at a time."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._held: Held | None = None
        self._lock = asyncio.Lock()

    @property
    def group_id(self) -> str | None:
        return self._held.id if self._held is not None else None

    async def join(self, request: GroupRequest) -> None:
        """Form this server's side of `request.group` (replacing any group it held)."""
        async with self._lock:
            self._held = None
            self._held = await asyncio.to_thread(join_group, request)

    async def receive(self, request: ReceiveRequest) -> int:
        """Receive every bucket, then load the tensors as `request.version`; returns the bytes received. At once
        (before the ready key, so the trainer broadcasts nothing): `GroupMismatch` when the group is not the one held,
        ValueError when the buckets' specs do not fill them. ValueError after draining every bucket when the tensors
        do not fit the model. The engine loads all the tensors at once, so it keeps every bucket until then."""
        async with self._lock:
            held = self._held
            if held is None or held.id != request.group:
                raise GroupMismatch(f"group: {request.group} is not the transfer group held here ({self.group_id})")
            if request.senders > len(held.groups):
                raise GroupMismatch(
                    f"senders: {request.senders} senders, the group held here has {len(held.groups)} member(s)"
                )
            buckets = bucket_layout(request.buckets)
            device = held.device(self.engine.device) if buckets else CPU
            tensors: dict[str, torch.Tensor] = {}
            held.store.set(ready_key(request.group, request.version), "1")  # the trainer broadcasts once set
            try:
                received = await asyncio.to_thread(
                    receive_buckets, held.groups[: request.senders], buckets, tensors.update, held.timeout_s, device
                )
            except TransferBroken:
                self._held = None  # the trainer went away or broke off mid-transfer: the group is gone
                raise
            load = self.engine.load_weights(
                tensors, request.version, request.rewind, label=request.path, drain=request.drain
            )
            await asyncio.wrap_future(load)
            return received


def _own_address(request: GroupRequest) -> str:
    """This host's address on the route to the trainer's store."""
    return route_address(request.address, request.port)


def route_address(host: str, port: int = 9) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP socket only picks its interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return sock.getsockname()[0]


# ---- the sending side ---------------------------------------------------------------------------------------


class Sender:
    """The trainer's side: a rendezvous store, one group per server (by URL), and the broadcasts.

    `address` is where the servers reach this process (`rollout.transfer_address`); `timeout_s` bounds forming a
    group and each whole transfer (`rollout.transfer_timeout_s`).
    """

    def __init__(self, address: str = "127.0.0.1", timeout_s: float = 60.0, backend: str = "gloo") -> None:
        self.address, self.timeout_s, self.backend = address, timeout_s, backend
        self._store = TCPStore(
            address, 0, None, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self._groups: dict[str, Held] = {}
        self._ids = itertools.count()
        self._run = uuid.uuid4().hex[:8]

    @property
    def port(self) -> int:
        """The rendezvous store's port (chosen free at start)."""
        return self._store.port

    def group_id(self, url: str) -> str | None:
        held = self._groups.get(url)
        return held.id if held is not None else None

    def drop(self, url: str) -> None:
        self._groups.pop(url, None)

    def request(self, url: str, senders: int = 1) -> GroupRequest:
        """A new group id for `url`, and the body that asks the server to join it (a pair group with each of
        `senders` senders)."""
        group = f"{self._run}-{next(self._ids)}"
        return GroupRequest(
            group=group,
            address=self.address,
            port=self.port,
            backend=self.backend,
            timeout_s=self.timeout_s,
            senders=senders,
        )

    def receivers(self, group: str) -> int:
        """How many workers of the server joined as `group` (the value of its joined key: `join_group`); the
        group's members are this sender and them."""
        value = self._store.get(joined_key(group)).decode()
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{joined_key(group)}: expected the server's worker count, got {value!r}")
        return int(value)

    def form(self, url: str, request: GroupRequest, receivers: int = 1) -> None:
        """This side (sender 0) of `request.group` with the server's `receivers` workers (blocks until they have
        formed theirs)."""
        name = member(request.group, 0, request.senders)
        group = pair_group(self._store, name, 0, self.backend, self.address, self.timeout_s, 1 + receivers)
        self._groups[url] = Held(request.group, [group], timeout_s=self.timeout_s)

    def send(self, url: str, buffers: list[torch.Tensor], abandon: threading.Event | None = None) -> int:
        """Broadcast the packed buckets `buffers` (host tensors, shared by every server's transfer) to `url`'s group
        (`send_buffers`); returns the bytes sent. On a failure the group is dropped."""
        try:
            return send_buffers(self._groups[url].group, buffers, self.timeout_s, abandon)
        except Exception:
            self.drop(url)  # the server's receive fails when it sees this group close, else at its timeout
            raise

    @property
    def store(self):
        """The rendezvous store (the trainer's other senders meet rank 0 there: components/rollout/senders.py)."""
        return self._store

    @property
    def run(self) -> str:
        """This sender's prefix of group ids and of its keys in the store."""
        return self._run

    def clear(self, key: str) -> None:
        self._store.delete_key(key)

    def arrived(self, key: str) -> bool:
        """Whether a server has set `key` in the store (it joined a group, or is ready to drain a transfer)."""
        return self._store.check([key])


def send_buffers(group, buffers: list[torch.Tensor], timeout_s: float, abandon: threading.Event | None = None) -> int:
    """Broadcast the packed buckets `buffers` (host tensors) over the pair `group`, all within `timeout_s`, at most
    `IN_FLIGHT` posted and not completed (module docstring); returns the bytes sent. TimeoutError at the deadline,
    ConnectionError once `abandon` is set (the server's call failed), RuntimeError when the peer fails: the group is
    then aborted (NCCL), its ops in flight held until they end."""
    deadline = time.monotonic() + timeout_s
    late = f"not done within rollout.transfer_timeout_s = {timeout_s:g} s"
    nccl = is_nccl(group)
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
    in_flight: deque[tuple[object, torch.Tensor]] = deque()  # (work, the tensor it sends) per bucket posted

    def finish_oldest() -> None:
        complete(group, in_flight[0][0], deadline, late, abandon)
        in_flight.popleft()

    try:
        # NCCL: the copies go on a stream of this transfer's own, and the broadcasts wait for it (module docstring)
        with torch.cuda.stream(torch.cuda.Stream(device) if nccl else None):
            for buffer in buffers:
                if len(in_flight) == IN_FLIGHT:
                    finish_oldest()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(late)
                sent = buffer if device is None else buffer.to(device, non_blocking=True)
                in_flight.append((post(group, sent, left), sent))
                fault_point("weights.bucket")  # a failure here leaves this bucket and the one before in flight
            while in_flight:
                finish_oldest()
    except Exception:  # RuntimeError (gloo, NCCL), OSError (a socket, the deadline): the group is gone
        abort(group)
        release_when_done(group, [work for work, _ in in_flight])
        raise
    return sum(buffer.numel() for buffer in buffers)
