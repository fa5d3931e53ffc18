"""Process groups of the collective weight transfer (components/rollout/transfer.py), one sender (rank 0) and a
server's workers (ranks 1..W: one for `sao engine serve`, one per tensor- or pipeline-parallel worker for vLLM):
forming one over gloo or NCCL, posting a broadcast, completing it on the host against a deadline, aborting it.

Every collective is completed on the host (`complete`: poll the work; at the deadline abort the group and raise
TimeoutError). Under NCCL `Work.wait()` only makes the current CUDA stream wait and returns at once (torch 2.13
`WorkNCCL::wait` blocks the host only given a timeout or TORCH_NCCL_BLOCKING_WAIT), so a stalled or dead peer never
reached the caller's `except`: only the group's watchdog saw it.

NCCL failures: torch 2.13's ProcessGroupNCCL reads TORCH_NCCL_ASYNC_ERROR_HANDLING in its constructor, default 3
(SkipCleanUp: on a collective's error or timeout the watchdog ends the process). A pair group is made with 2
(CleanUpOnly: abort its communicators, keep the process), set only while it is constructed, so the process's other
groups (the trainer's training group) keep theirs; and with twice the timeout, so the host's deadline aborts it
first (an op aborted before its own timeout retires without an error). A failure its watchdog does see still
signals the process's first group's monitor, which dumps and then ends the process unless it runs with
TORCH_NCCL_DUMP_ON_TIMEOUT=0 (docs/production.md). `distributed_c10d._abort_process_group` takes only groups
registered by `init_process_group`/`new_group`, not these bare backends: `ProcessGroupNCCL.abort()` aborts them.
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

POLL_S = (0.0005, 0.02)
"""First and longest pause between two polls of a collective (it doubles): short waits for short ones, few wake-ups."""
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"
"""ErrorHandlingMode CleanUpOnly (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp): abort, never end the process."""

_env_lock = threading.Lock()


def pair_group(store, group: str, rank: int, backend: str, host: str, timeout_s: float, size: int = 2):
    """This side (`rank` 0: the trainer's sender, 1..`size` - 1: a server's workers) of the group `group` of `size`
    members over `store`. An NCCL one is made with TORCH_NCCL_ASYNC_ERROR_HANDLING=CleanUpOnly, its failure aborting
    it, not the process (module docstring)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = PrefixStore(f"{group}/", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(prefixed, rank, size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = 2 * timeout  # the watchdog's, behind the host's deadline (module docstring)
        with _env_lock:  # read once, by the constructor: the process's other groups keep their own setting
            before = os.environ.get(ASYNC_ERROR_HANDLING)
            os.environ[ASYNC_ERROR_HANDLING] = CLEAN_UP_ONLY
            try:
                return dist.ProcessGroupNCCL(prefixed, rank, size, options)
            finally:
                if before is None:
                    del os.environ[ASYNC_ERROR_HANDLING]
                else:
                    os.environ[ASYNC_ERROR_HANDLING] = before
    raise ValueError(f"backend: expected gloo or nccl, got {backend!r}")


def post(group, buffer: torch.Tensor, timeout_s: float | None = None):
    """Start broadcasting `buffer` from rank 0 over `group`; returns its work, to `complete`. gloo ends the op after
    `timeout_s` (None: the group's timeout); NCCL keeps the group's, and `complete` aborts it at the deadline."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    if timeout_s is not None:
        options.timeout = datetime.timedelta(seconds=timeout_s)
    return group.broadcast([buffer], options)


def complete(group, work, deadline: float, late: str, abandon: threading.Event | None = None) -> None:
    """Wait on this host until `work`, a collective of `group`, has completed, and raise its error if it failed. At
    `deadline` (`time.monotonic()`) abort the group and raise TimeoutError(`late`); once `abandon` is set, abort it
    and raise ConnectionError. Under NCCL the current CUDA stream is then ordered after the collective."""
    pause = POLL_S[0]
    while not work.is_completed():
        if abandon is not None and abandon.is_set():
            abort(group)
            raise ConnectionError("abandoned: the other side's call failed")
        left = deadline - time.monotonic()
        if left <= 0:
            abort(group)
            raise TimeoutError(late)
        time.sleep(min(pause, left))
        pause = min(2 * pause, POLL_S[1])
    try:
        work.wait()  # completed: returns at once, or raises the collective's error
    except Exception:
        abort(group)  # NCCL: the whole group, before its watchdog takes the error for its own
        raise


def abort(group) -> None:
    """End `group`'s collectives in flight: NCCL aborts its communicators (`ProcessGroupNCCL.abort`). gloo has no
    call that interrupts a pending op (neither `abort` nor `shutdown` does, measured with torch 2.13): each of its
    ops ends at the timeout it was posted with."""
    if is_nccl(group):
        group.abort()


def release_when_done(group, works: list) -> None:
    """Hold `group` in a thread of its own until `works`, its ops in flight, have ended (gloo's at their timeouts,
    NCCL's once aborted): its destructor joins them, and the caller dropping it may be the trainer's event loop."""

    def hold(group=group, works=works) -> None:
        for work in works:
            try:
                work.wait()
            except (RuntimeError, OSError):
                pass  # the group has failed already: this op's own error says nothing more

    threading.Thread(target=hold, name="transfer-group-release", daemon=True).start()


def broadcast(group, buffer: torch.Tensor, timeout_s: float = 60.0) -> None:
    """Broadcast `buffer` from rank 0 over `group`, completed on this host within `timeout_s`."""
    complete(group, post(group, buffer, timeout_s), time.monotonic() + timeout_s, f"not done within {timeout_s:g} s")


def is_nccl(group) -> bool:
    """Whether `group` is a ProcessGroupNCCL (its class is absent from a CPU build of torch)."""
    return type(group).__name__ == "ProcessGroupNCCL"
