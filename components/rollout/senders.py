"""Weights from every rank (`rollout.transfer_senders = "all"`): a version's buckets leave from every trainer rank that
holds the policy, bucket i from sender i mod S, each sender over a pair group of its own with each server, so that S
links carry it instead of rank 0's alone (issue 44; `make bench BENCH=senders` measures the mechanism).

Rank 0 runs the collective transport (transports.py: the servers' HTTP calls, the retries, the fallback) and its
rendezvous store; it is sender 0. Each other policy rank is a follower: a `FollowerSender`, whose commands run on
threads of their own beside its training. They meet in three ways:

- **Staging.** The learner's `weights` message carries a `Share` (the version, the bucket plan, the store's address):
  every follower packs its buckets of that version from its own copy of the weights (under ZeRO-3 while the gathers
  hold them whole; the packing copies) and the message ends with a gather of the followers' answers, so rank 0 knows
  that every follower holds the version before any of it is sent. A version some follower lacks (the starting
  weights, a failed staging) goes from rank 0 alone (`senders = 1` in its receive request).
- **Commands.** Rank 0 posts numbered commands to the store (`{run}/cmd/{n}`, JSON): `form` (a follower's pair group
  with a server, `member(group, index, S)`: the server forms one per sender, in order) and `send` (a staged version
  to a server, once the server has set its ready key). Each follower reads them in order and runs each on a thread
  of its own (a form and the sends to two servers may overlap); it answers in `{run}/cmd/{n}/{index}`: `ok:<bytes>`
  or `error:<what>`.
- **Failures.** Rank 0 waits for every answer within `rollout.transfer_timeout_s`; an error or a silence fails the
  transfer as a failure of its own send would: the server's receive fails (its groups aborted, so the other senders'
  broadcasts end), the transport retries once on a new group and then sends through the filesystem path. A whole
  version or none: the server loads only after every bucket has come.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
from torch.distributed import TCPStore

from components.rollout.pairs import pair_group
from components.rollout.transfer import CPU, Bucket, Sender, member, pack, route_address, send_buffers

KEEP_SHARES = 3
"""Versions a follower keeps packed: the one in transfer, the next, and one a reviving server may still ask for."""
WAIT_S = 30.0
"""A follower's wait for the next command before it checks that rank 0's store still answers."""


@dataclass
class Share:
    """What rank 0 asks its followers to stage of `version` (sent with the learner's `weights` message)."""

    version: int
    buckets: list[Bucket]
    """The transfer's bucket plan (the same for every version: the shapes do not change)."""
    senders: int
    address: str
    port: int
    run: str
    """The rendezvous store of rank 0's transport and the prefix of its keys and group ids."""
    backend: str = "gloo"
    timeout_s: float = 60.0
    staged: bool = False
    """Set on rank 0 once every follower has staged the version (the `weights` message's gather)."""

    def indices(self, sender: int) -> range:
        """The buckets sender `sender` sends."""
        return range(sender, len(self.buckets), self.senders)

    def names(self, sender: int) -> set[str]:
        """The tensors of those buckets (what a follower copies out of ZeRO-3's gathers)."""
        return {name for i in self.indices(sender) for name, _, _ in self.buckets[i][1]}


class FollowerSender:
    """Sender `index` > 0: a trainer rank other than rank 0 that stages its buckets of each shared version and runs
    rank 0's commands (module docstring)."""

    def __init__(self, index: int, share: Share, device: torch.device = CPU) -> None:
        self.index, self.run, self.backend, self.timeout_s = index, share.run, share.backend, share.timeout_s
        self.device = device
        """This rank's device: an NCCL send copies its buckets there (each command's thread is set to it)."""
        self.address, self.port = share.address, share.port
        # A TCPStore client holds its lock through a blocking call: the wait for the next command has a client of its
        # own, each group's rendezvous another, and the answers this one.
        self.store = self._client()
        self._staged: dict[int, list[torch.Tensor]] = {}
        self._changed = threading.Condition()
        self._groups: dict[str, tuple[str, object]] = {}
        """url -> (transfer group id, this sender's pair group with that server)."""
        self._closed = threading.Event()
        threading.Thread(target=self._serve, name=f"weights-sender-{index}", daemon=True).start()

    def stage(self, share: Share, weights: dict[str, torch.Tensor]) -> None:
        """Pack this sender's buckets of `share.version` from `weights` (copied: they may move once this returns)."""
        pinned = self.backend == "nccl"  # each server's copy to the GPU goes at twice the pageable speed
        buffers = [pack(weights, share.buckets[i], CPU, pinned) for i in share.indices(self.index)]
        with self._changed:
            self._staged[share.version] = buffers
            for old in sorted(self._staged)[:-KEEP_SHARES]:
                del self._staged[old]
            self._changed.notify_all()

    def close(self) -> None:
        self._closed.set()

    def _client(self) -> TCPStore:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        return TCPStore(self.address, self.port, None, False, timeout=timeout)

    def _serve(self) -> None:
        """Read rank 0's commands in order, each run on a thread of its own (one posted longer ago than the timeout
        is skipped: rank 0 has given up on it); return once the store is gone."""
        store = self._client()
        for n in itertools.count():
            key = f"{self.run}/cmd/{n}"
            while not self._waited(store, key):
                if self._closed.is_set():
                    return
            if self._closed.is_set():
                return
            try:
                command = json.loads(store.get(key))
            except RuntimeError:  # rank 0 ended between the two calls
                return
            if time.time() - command["posted"] < self.timeout_s:
                threading.Thread(target=self._answer, args=(key, command), daemon=True).start()

    def _waited(self, store: TCPStore, key: str) -> bool:
        """Whether `key` is set, after waiting up to `WAIT_S`; closes this sender when the store no longer answers."""
        try:
            store.wait([key], datetime.timedelta(seconds=WAIT_S))
            return True
        except RuntimeError:  # the wait's timeout, or a store that has gone away with rank 0
            try:
                store.check([key])
            except RuntimeError:
                self._closed.set()
            return False

    def _answer(self, key: str, command: dict) -> None:
        if self.device.type == "cuda":  # a new thread starts on device 0: NCCL's group and copies belong to this rank's
            torch.cuda.set_device(self.device)
        try:
            if command["kind"] == "form":
                answer = f"ok:{self._form(command)}"
            elif command["kind"] == "send":
                answer = f"ok:{self._send(command)}"
            else:
                raise ValueError(f"kind: unknown command {command['kind']!r}")
        except Exception as exc:  # answered to rank 0, whose transfer then fails and is retried
            answer = f"error:{type(exc).__name__}: {exc}"
        try:
            self.store.set(f"{key}/{self.index}", answer)
        except RuntimeError:
            self._closed.set()

    def _form(self, command: dict) -> int:
        url, group, senders = command["url"], command["group"], command["senders"]
        receivers = command.get("receivers", 1)  # the server's workers, each a member of this sender's group
        host = route_address(urlsplit(url).hostname or "127.0.0.1")  # gloo binds on the interface that reaches it
        name = member(group, self.index, senders)
        pair = pair_group(self._client(), name, 0, self.backend, host, self.timeout_s, 1 + receivers)
        self._groups[url] = (group, pair)
        return 0

    def _send(self, command: dict) -> int:
        url, group, version = command["url"], command["group"], command["version"]
        held = self._groups.get(url)
        if held is None or held[0] != group:
            raise LookupError(f"group: sender {self.index} holds no group {group} with {url}")
        with self._changed:
            if not self._changed.wait_for(lambda: version in self._staged, self.timeout_s):
                raise LookupError(f"version: v{version} is not staged on sender {self.index} ({sorted(self._staged)})")
            buffers = self._staged[version]
        try:
            return send_buffers(held[1], buffers, self.timeout_s)
        except Exception:
            self._groups.pop(url, None)  # the group is gone: rank 0 forms a new one
            raise


class Followers:
    """Rank 0's side of the other senders: shares, commands and their answers (module docstring)."""

    def __init__(self, sender: Sender, senders: int) -> None:
        self.sender, self.senders, self.store, self.timeout_s = sender, senders, sender.store, sender.timeout_s
        self._numbers = itertools.count()
        self._shares: dict[int, Share] = {}

    def share(self, version: int, buckets: list[Bucket]) -> Share:
        """The share of `version` to hand the learner's `weights` message (kept to tell whether it was staged)."""
        s = self.sender
        share = Share(version, buckets, self.senders, s.address, s.port, s.run, s.backend, s.timeout_s)
        self._shares[version] = share
        for old in sorted(self._shares)[:-KEEP_SHARES]:
            del self._shares[old]
        return share

    def senders_for(self, version: int, buckets: list[Bucket]) -> int:
        """How many senders send `version` staged with `buckets`: all where every follower staged it with that plan,
        else rank 0 alone."""
        share = self._shares.get(version)
        return self.senders if share is not None and share.staged and share.buckets == buckets else 1

    def post(self, kind: str, **fields) -> str:
        """Post a command to every follower; returns its key (to `answers`)."""
        key = f"{self.sender.run}/cmd/{next(self._numbers)}"
        self.store.set(key, json.dumps({"kind": kind, "posted": time.time(), **fields}))
        return key

    async def answers(self, key: str) -> int:
        """Wait for every follower's answer to command `key` within the transfer's timeout; returns the bytes they
        sent. RuntimeError naming each follower that failed, TimeoutError naming those that did not answer."""
        pending = {f"{key}/{index}": index for index in range(1, self.senders)}
        deadline, sent, failed = time.monotonic() + self.timeout_s, 0, []
        while pending:
            for answer_key, index in list(pending.items()):
                if self.store.check([answer_key]):
                    text = self.store.get(answer_key).decode()
                    self.store.delete_key(answer_key)
                    del pending[answer_key]
                    if text.startswith("error:"):
                        failed.append(f"sender {index}: {text.removeprefix('error:')}")
                    else:
                        sent += int(text.removeprefix("ok:"))
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"sender(s) {sorted(pending.values())} did not answer {key} within "
                    f"rollout.transfer_timeout_s = {self.timeout_s:g} s"
                )
            if pending:
                await asyncio.sleep(0.005)
        self.store.delete_key(key)
        if failed:
            raise RuntimeError("; ".join(failed))
        return sent
