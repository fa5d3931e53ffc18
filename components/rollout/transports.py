"""How a policy version reaches an external server (`rollout.weight_transfer`), behind one interface.

- `FilesystemTransport` ("filesystem"): the version is written as an HF model directory
  `publish_dir/v{version:08d}` (atomically) and its path posted to the server, which reads it. The servers
  must see `publish_dir` at the same path (same machine or a shared volume). The last two directories are
  kept (a reviving server may still be loading the previous one).
- `CollectiveTransport` ("collective"): the tensors go in buckets over a process group between the trainer
  and each server (components/rollout/transfer.py); no file is written. With `rollout.transfer_senders = "all"`
  every trainer rank that holds the policy sends its share of the buckets (components/rollout/senders.py). A
  transfer that fails (the group fails, it passes `rollout.transfer_timeout_s`, or the server's call fails, which
  stops the broadcast at once) is retried once on a new group, then, with `fallback`, sent through the filesystem
  path; both are counted (`rollout/transfer_retries`, `rollout/transfer_fallbacks`).

Both send from the trainer's host copy of the version (`HttpRollouts` stages each version into it), so a
server that revives in the middle of the next training step still gets the whole version, never a torn one.
The label a server reports after a load (`/health` `path`) is `publish_dir/v{version:08d}` for both, so a
resumed trainer tells its own versions from another run's the same way (backends.py).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Protocol

import httpx
import torch
from torch import nn

from components.models import save_model_dir
from components.rollout.client import EngineClient, EngineError
from components.rollout.senders import Followers, Share
from components.rollout.transfer import Sender, joined_key, pack, plan_buckets, ready_key, unpack
from components.storage import MARKER, atomic_dir

PUBLISHED = re.compile(r"v\d{8}")
CONFLICT = 409
"""The server holds another transfer group than the one named (transfer.GroupMismatch): form it again."""
KEEP_STAGED = 2


class Transport(Protocol):
    copies: bool
    """Whether `stage` copies `weights` (then they may be the trainer's live tensors, and staging must end before
    the trainer moves them); else it keeps them, and the caller passes a copy."""
    bytes: int
    """Bytes moved to servers so far (cumulative)."""

    def stage(self, weights: dict[str, torch.Tensor], version: int) -> tuple[str, dict[str, torch.Tensor]]:
        """Make `weights` ready to send as `version`; returns the label the servers will report and the host
        tensors now held for it. The last `KEEP_STAGED` versions stay ready: a server reviving with the previous
        one while the next is staged still gets the whole of it."""

    async def load(self, client: EngineClient, label: str, version: int, rewind: bool) -> None:
        """Bring the server behind `client` to the staged `version` (raises what the pool reads as a failure)."""

    def metrics(self) -> dict[str, float]: ...

    def share(self, version: int) -> Share | None:
        """What the trainer's other ranks should stage of `version` to send it themselves (None: rank 0 sends it)."""


def version_dir(publish_dir: Path, version: int) -> Path:
    return publish_dir / f"v{version:08d}"


class FilesystemTransport:
    """Versions as HF directories under `publish_dir`, read by the servers (module docstring)."""

    copies = False

    def __init__(self, template: nn.Module, tokenizer, publish_dir: Path) -> None:
        self.template, self.tokenizer, self.publish_dir = template, tokenizer, publish_dir
        self._published: list[Path] = []
        self.bytes = 0
        self._size = 0  # bytes of the version staged last: what each server reads of it

    def stage(self, weights: dict[str, torch.Tensor], version: int) -> tuple[str, dict[str, torch.Tensor]]:
        path = version_dir(self.publish_dir, version)
        if path not in self._published:
            assign_weights(self.template, weights)
            with atomic_dir(path) as tmp:
                save_model_dir(self.template, self.tokenizer, tmp)
            self._published.append(path)
            self._prune()
            self._size = _state_bytes(weights)
        return str(path), weights

    async def load(self, client: EngineClient, label: str, version: int, rewind: bool) -> None:
        await client.publish_weights(label, version, rewind)
        self.bytes += self._size

    def metrics(self) -> dict[str, float]:
        return {}

    def share(self, version: int) -> None:
        return None

    def remove_above(self, version: int) -> None:
        """Remove the published directories of versions above `version` (a crashed predecessor's)."""
        if self.publish_dir.is_dir():
            for path in self.publish_dir.iterdir():
                if PUBLISHED.fullmatch(path.name) and int(path.name[1:]) > version:
                    (path / MARKER).unlink(missing_ok=True)  # as `atomic_fill` does: never half-deleted yet complete
                    shutil.rmtree(path)

    def _prune(self) -> None:
        """Remove every published directory but the last `KEEP_STAGED` this object wrote."""
        keep = set(self._published[-KEEP_STAGED:])
        self._published = self._published[-KEEP_STAGED:]
        for path in self.publish_dir.iterdir():
            if PUBLISHED.fullmatch(path.name) and path not in keep:
                shutil.rmtree(path, ignore_errors=True)


class CollectiveTransport:
    """Buckets over a process group per server (module docstring); `fallback` takes a server the group fails."""

    copies = True  # each version is packed into its buckets once, and sent from them to every server

    def __init__(
        self,
        publish_dir: Path,
        bucket_bytes: int,
        address: str = "127.0.0.1",
        timeout_s: float = 60.0,
        fallback: FilesystemTransport | None = None,
        log=print,
        backend: str = "gloo",
        senders: int = 1,
    ) -> None:
        self.publish_dir, self.bucket_bytes = publish_dir, bucket_bytes
        self.timeout_s, self.fallback, self.log = timeout_s, fallback, log
        self.sender = Sender(address, timeout_s, backend)
        self.followers = Followers(self.sender, senders) if senders > 1 else None
        """The trainer's other ranks that send their share of each version (senders.py); None: rank 0 sends all."""
        log(
            f"rollout: collective weight transfer over {backend}: rendezvous store at {address}:{self.sender.port}, "
            f"buckets of {bucket_bytes / 2**20:g} MB, sent by {senders} rank(s)"
        )
        self.sent, self.retries, self.fallbacks, self.senders_used = 0, 0, 0, 1
        self._members: dict[str, int] = {}
        """url -> the senders its group was formed with (a group formed before the followers ran has rank 0 alone)."""
        self._plan: list | None = None
        """The bucket plan of the version staged last (the same for every version), shared with the other ranks."""
        self._staged: dict[int, tuple[dict[str, torch.Tensor], list, list[torch.Tensor]]] = {}
        """version -> (its tensors, viewed out of its buckets; the buckets' manifest; the packed buckets), for the
        last `KEEP_STAGED` versions."""

    def stage(self, weights: dict[str, torch.Tensor], version: int) -> tuple[str, dict[str, torch.Tensor]]:
        unique = _unique_tensors(weights)
        buckets = plan_buckets(unique, self.bucket_bytes)
        pinned = self.sender.backend == "nccl"  # each server's copy to the GPU goes at twice the pageable speed
        buffers = [pack(unique, bucket, torch.device("cpu"), pinned) for bucket in buckets]
        views = {name: t for buffer, (_, specs) in zip(buffers, buckets) for name, t in unpack(buffer, specs).items()}
        held = {name: views[name] if name in views else views[_twin(name, weights, unique)] for name in weights}
        self._staged[version] = (held, buckets, buffers)
        self._plan = buckets
        for old in sorted(self._staged)[:-KEEP_STAGED]:
            del self._staged[old]
        return str(version_dir(self.publish_dir, version)), held

    async def load(self, client: EngineClient, label: str, version: int, rewind: bool) -> None:
        failure: Exception | None = None
        for attempt in range(2):
            try:
                senders = self._senders_for(version)
                if attempt or self._members.get(client.base_url, 0) < senders or not await self._holds_group(client):
                    await self._form(client, senders)
                await self._transfer(client, label, version, rewind, senders)
                return
            except (OSError, httpx.HTTPError, EngineError, RuntimeError) as exc:  # OSError: sockets, timeouts
                if isinstance(exc, EngineError) and exc.status < 500 and exc.status != CONFLICT:
                    raise  # the server refused the update (a version not above its own): not the transport's fault
                self.sender.drop(client.base_url)
                failure = exc
                if attempt == 0:
                    self.retries += 1
        if self.fallback is None:
            raise ConnectionError(f"collective transfer of v{version} to {client.base_url}: {failure}") from failure
        self.fallbacks += 1
        self.log(
            f"rollout: collective transfer of v{version} to {client.base_url} failed twice ({failure}); "
            "sending it through the filesystem path"
        )
        path, _ = await asyncio.to_thread(self.fallback.stage, self._staged[version][0], version)  # its own module
        await self.fallback.load(client, path, version, rewind)

    @property
    def bytes(self) -> int:
        return self.sent + (self.fallback.bytes if self.fallback else 0)

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/transfer_retries": float(self.retries),
            "rollout/transfer_fallbacks": float(self.fallbacks),
            "rollout/transfer_senders": float(self.senders_used),
        }

    def share(self, version: int) -> Share | None:
        if self.followers is None or self._plan is None:
            return None
        return self.followers.share(version, self._plan)

    async def _holds_group(self, client: EngineClient) -> bool:
        """Whether the server holds this side's group with it (a restarted server holds none, or another)."""
        group = self.sender.group_id(client.base_url)
        if group is None:
            return False
        info = await client.health_info(self.timeout_s)
        return info is not None and info.get("transfer_group") == group

    def _senders_for(self, version: int) -> int:
        """How many ranks send `version` (senders.py): every policy rank once each has staged it, else rank 0."""
        if self.followers is None or version not in self._staged:
            return 1
        return self.followers.senders_for(version, self._staged[version][1])

    async def _form(self, client: EngineClient, senders: int) -> None:
        """A new group with the server, with a member for each of `senders` senders and each of the server's workers
        (their count is the value of its joined key): its join is awaited in the store before this side forms, so a
        server that never joins fails the post at once instead of blocking this rank until the timeout."""
        url, request = client.base_url, self.sender.request(client.base_url, senders)
        self._members.pop(url, None)
        join = asyncio.create_task(client.join_group(request.model_dump()))
        await self._arrival(joined_key(request.group), join, client)
        receivers = self.sender.receivers(request.group)  # the server's workers: each is a member of every group
        asked = None
        if senders > 1:
            asked = self.followers.post("form", url=url, group=request.group, senders=senders, receivers=receivers)
        try:
            await asyncio.to_thread(self.sender.form, url, request, receivers)
            await join
            if asked is not None:
                await self.followers.answers(asked)
        except BaseException:
            join.cancel()
            await asyncio.gather(join, return_exceptions=True)
            raise
        self._members[url] = senders

    async def _transfer(self, client: EngineClient, label: str, version: int, rewind: bool, senders: int) -> None:
        if version not in self._staged:
            raise ValueError(f"version: v{version} is not staged (staged: {sorted(self._staged)})")
        _, buckets, buffers = self._staged[version]
        url, group = client.base_url, self.sender.group_id(client.base_url)
        body = {"group": group, "version": version, "rewind": rewind, "path": label, "buckets": buckets}
        if senders > 1:
            body["senders"] = senders
        post = asyncio.create_task(client.receive_weights(body))
        abandon = threading.Event()  # the server's call failed: the broadcast stops at once, not at the deadline
        post.add_done_callback(lambda call: (call.cancelled() or call.exception() is not None) and abandon.set())
        try:
            key = ready_key(group, version)
            await self._arrival(key, post, client)
            self.sender.clear(key)
            asked = self.followers.post("send", url=url, group=group, version=version) if senders > 1 else None
            sent = await asyncio.to_thread(self.sender.send, url, buffers[::senders], abandon)  # sender 0's buckets
            if asked is not None:
                sent += await self.followers.answers(asked)
        except BaseException:
            post.cancel()  # the server's answer (its failed receive) says nothing more than this error
            await asyncio.gather(post, return_exceptions=True)
            raise
        await post
        self.senders_used = senders
        self.sent += sent  # after the await: `self.sent += await ...` would read it before other loads add theirs

    async def _arrival(self, key: str, call: asyncio.Task, client: EngineClient) -> None:
        """Wait until the server has set `key`; raise the call's own error when it fails first. The wait allows two
        timeouts: the server may first be finishing a transfer that broke while both sides lived, which only its
        own timeout ends (gloo notices a peer's death at once, but nothing interrupts a pending receive: neither
        side's `abort` or `shutdown` does, measured with torch 2.13)."""
        wait_s = 2 * self.timeout_s
        deadline = time.monotonic() + wait_s
        while not self.sender.arrived(key):
            if call.done():
                call.result()  # raises the server's refusal or the connection error
                raise ConnectionError(f"the server answered before it set {key}")
            if client.draining:  # vLLM: the update waits for this client's requests in flight, not yet the server
                deadline = time.monotonic() + wait_s
            elif time.monotonic() > deadline:
                call.cancel()
                raise TimeoutError(f"no {key} from the server within {wait_s:g} s")
            await asyncio.sleep(0.005)


def assign_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Make `weights` the module's own tensors (no copy; `weights` must stay unchanged while the module is used),
    tied parameters tied again."""
    with torch.no_grad():
        module.load_state_dict(weights, strict=False, assign=True)
    if hasattr(module, "tie_weights"):
        module.tie_weights()


def _unique_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` without the second name of a tied tensor (the receiver's check accepts it missing)."""
    seen, out = set(), {}
    for name, tensor in weights.items():
        if tensor.numel() == 0 or tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor
    return out


def _twin(name: str, weights: dict[str, torch.Tensor], unique: dict[str, torch.Tensor]) -> str:
    """The name under which `unique` holds the tensor `name` shares its storage with (a tied weight)."""
    ptr = weights[name].data_ptr()
    return next(other for other, tensor in unique.items() if tensor.data_ptr() == ptr)


def _state_bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in _unique_tensors(weights).values())
