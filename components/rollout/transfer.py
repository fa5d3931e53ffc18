"""The collective weight transport: checkpoint-named tensors in buckets, broadcast from the trainer to a server over
a process group, with no file written (`rollout.weight_transfer = "collective"`).

Each server gets a two-member group of its own with the trainer's sending rank (rank 0, which hosts the
rendezvous store; the server is rank 1): gloo on CPU, NCCL where the server's model is on a GPU. A group per
server means a server that restarts or joins forms its own without touching the others, and a dead peer is
seen at once (gloo: "connection closed by peer"). Two routes of `sao engine serve`, both behind the weights
token (components/rollout/access.py):

1. `POST /v1/weights/group {"group", "address", "port", "backend", "timeout_s"}`: the server joins the group
   whose store listens at address:port; the call returns once both sides have formed it, so the trainer forms
   its side at the same time. `/health` reports the group the server holds (`transfer_group`): one that
   differs from the trainer's (a restarted server holds none) is formed again before the next transfer.
2. `POST /v1/weights/receive {"group", "version", "rewind", "path", "buckets"}`: `buckets` lists, per bucket,
   its size in bytes and the `[name, dtype, shape]` of each tensor in it. The server receives every bucket
   (always all of them, into scratch if it then refuses the update, so the trainer's broadcast never hangs on
   a refusal), views the tensors out of it, and loads them into the engine between decode steps as `version`;
   `path` is only the label `/health` reports (`publish_dir/v{version:08d}`, never written), so a resumed
   trainer tells its own versions from another run's as it does for the filesystem path.

Tensors are laid out in a bucket at 16-byte aligned offsets, so every one is viewed, not copied, out of it.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import socket
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch.distributed import PrefixStore, TCPStore

from components.faults import fault_point

ALIGN = 16
"""Byte alignment of each tensor in a bucket (any dtype can be viewed at it)."""
Spec = tuple[str, str, tuple[int, ...]]
"""(name, dtype name as torch spells it without `torch.`, shape) of one tensor."""


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


class ReceiveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group: str = Field(min_length=1)
    version: int = Field(ge=0)
    rewind: bool = False
    path: str | None = None
    """What `/health` reports as the weights' path once loaded (a label: nothing is read from it)."""
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


def plan_buckets(weights: dict[str, torch.Tensor], bucket_bytes: int) -> list[tuple[int, list[Spec]]]:
    """Split `weights` (in their order) into buckets of at most `bucket_bytes` (a larger tensor is a bucket of its
    own): per bucket, its size in bytes and the specs of its tensors."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be > 0, got {bucket_bytes}")
    buckets: list[tuple[int, list[Spec]]] = []
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


def pack(
    weights: dict[str, torch.Tensor], bucket: tuple[int, list[Spec]], device: torch.device, pinned: bool = False
) -> torch.Tensor:
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


# ---- the process group --------------------------------------------------------------------------------------


def pair_group(store, group: str, rank: int, backend: str, host: str, timeout_s: float):
    """This side (`rank` 0: the trainer, 1: a server) of the two-member group `group` over `store`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = PrefixStore(f"{group}/", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(prefixed, rank, 2, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    raise ValueError(f"backend: expected gloo or nccl, got {backend!r}")


def broadcast(group, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()


@dataclass
class _Held:
    id: str
    group: object
    store: object = None


def joined_key(group: str) -> str:
    return f"{group}/joined"


def ready_key(group: str, version: int) -> str:
    return f"{group}/ready/{version}"


class Receiver:
    """A server's side: the group it holds and the transfers over it, one at a time."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._held: _Held | None = None
        self._lock = asyncio.Lock()

    @property
    def group_id(self) -> str | None:
        return self._held.id if self._held is not None else None

    async def join(self, request: GroupRequest) -> None:
        """Form this server's side of `request.group` (replacing any group it held)."""
        async with self._lock:
            self._held = None

            def form():
                store = TCPStore(
                    request.address,
                    request.port,
                    None,
                    False,
                    timeout=datetime.timedelta(seconds=request.timeout_s),
                )
                store.set(joined_key(request.group), "1")  # the trainer forms its side once this is there
                # gloo binds this side's pair sockets on the interface that reaches the trainer
                host = "127.0.0.1" if request.address in ("127.0.0.1", "localhost") else _own_address(request)
                return store, pair_group(store, request.group, 1, request.backend, host, request.timeout_s)

            store, group = await asyncio.to_thread(form)
            self._held = _Held(request.group, group, store)

    async def receive(self, request: ReceiveRequest) -> int:
        """Receive every bucket, then load the tensors as `request.version`; returns the bytes received.
        `GroupMismatch` at once (before the ready key, so the trainer broadcasts nothing) when the group is not the
        one held; ValueError after draining every bucket when the tensors do not fit the model."""
        async with self._lock:
            held = self._held
            if held is None or held.id != request.group:
                raise GroupMismatch(f"group: {request.group} is not the transfer group held here ({self.group_id})")
            device = self.engine.device if request.buckets and _is_nccl(held.group) else torch.device("cpu")

            def drain() -> dict[str, torch.Tensor]:
                tensors: dict[str, torch.Tensor] = {}
                for size, specs in request.buckets:
                    buffer = torch.empty(size, dtype=torch.uint8, device=device)
                    broadcast(held.group, buffer)
                    tensors.update(unpack(buffer, [(n, d, tuple(s)) for n, d, s in specs]))
                return tensors

            held.store.set(ready_key(request.group, request.version), "1")  # the trainer broadcasts once set
            try:
                tensors = await asyncio.to_thread(drain)
            except RuntimeError:
                self._held = None  # the trainer went away or broke off mid-transfer: the group is gone
                raise
            load = self.engine.load_weights(tensors, request.version, request.rewind, label=request.path)
            await asyncio.wrap_future(load)
            return sum(size for size, _ in request.buckets)


def _is_nccl(group) -> bool:
    return type(group).__name__ == "ProcessGroupNCCL"


def _own_address(request: GroupRequest) -> str:
    """This host's address on the route to the trainer's store."""
    return route_address(request.address, request.port)


def route_address(host: str, port: int = 9) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP socket only picks its interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return sock.getsockname()[0]


class Sender:
    """The trainer's side: a rendezvous store, one group per server (by URL), and the broadcasts.

    `address` is where the servers reach this process (`rollout.transfer_address`).
    """

    def __init__(self, address: str = "127.0.0.1", timeout_s: float = 60.0, backend: str = "gloo") -> None:
        self.address, self.timeout_s, self.backend = address, timeout_s, backend
        self._store = TCPStore(
            address, 0, None, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self._groups: dict[str, _Held] = {}
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

    def request(self, url: str) -> GroupRequest:
        """A new group id for `url`, and the body that asks the server to join it."""
        group = f"{self._run}-{next(self._ids)}"
        return GroupRequest(
            group=group, address=self.address, port=self.port, backend=self.backend, timeout_s=self.timeout_s
        )

    def form(self, url: str, request: GroupRequest) -> None:
        """This side of `request.group` (blocks until the server forms its side)."""
        group = pair_group(self._store, request.group, 0, self.backend, self.address, self.timeout_s)
        self._groups[url] = _Held(request.group, group)

    def send(self, url: str, buffers: list[torch.Tensor]) -> int:
        """Broadcast the packed buckets `buffers` (host tensors, shared by every server's transfer) to `url`'s group;
        returns the bytes sent. RuntimeError when the peer fails."""
        held = self._groups[url]
        device = torch.device("cuda", torch.cuda.current_device()) if _is_nccl(held.group) else None
        try:
            for buffer in buffers:
                broadcast(held.group, buffer if device is None else buffer.to(device, non_blocking=True))
                fault_point("weights.bucket")
        except Exception:  # gloo's RuntimeError, a socket's OSError: the group is gone, the peer too perhaps
            self.drop(url)  # the server's receive fails when it sees this process die, else at its timeout
            raise
        return sum(buffer.numel() for buffer in buffers)

    def clear(self, key: str) -> None:
        self._store.delete_key(key)

    def arrived(self, key: str) -> bool:
        """Whether a server has set `key` in the store (it joined a group, or is ready to drain a transfer)."""
        return self._store.check([key])
