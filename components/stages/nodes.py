"""A run across nodes needs one run home that every node sees: rank 0 writes the SFT policy the others load, the
ranks write their partitions of each checkpoint into the home's scratch and rank 0 publishes them, and a resumed
run reads every rank's files back. A home on each node's own disk would look fine until the first checkpoint; so
the stages check it as they start (`check_shared_home`, from `components.stages.sft.world`), and every rank fails
with the same message naming the ranks and hosts that do not see rank 0's home.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

from components.storage import HomeStateError
from components.training.engines.collective import Collective, launched_world_size, local_world_size

PROBES = Path("cache") / "nodes"
"""Where under the home rank 0 writes the file every rank must read back (removed once read)."""


def across_nodes() -> bool:
    """This torchrun job spans more than one node (its world is larger than this node's share of it)."""
    return launched_world_size() > local_world_size()


def check_shared_home(comm: Collective, home: Path) -> None:
    """Every rank of `comm` reads back a file rank 0 has just written under `home`, or every rank raises
    HomeStateError naming those that could not. Collective: every rank calls it."""
    if not comm.distributed:
        return
    name = None
    if comm.is_driver:
        name = f"{socket.gethostname()}-{secrets.token_hex(8)}"
        (Path(home) / PROBES).mkdir(parents=True, exist_ok=True)
        (Path(home) / PROBES / name).write_text(name)
    name = comm.broadcast(name)
    probe = Path(home) / PROBES / name
    try:
        seen = probe.read_text() == name
    except OSError:
        seen = False
    answers = comm.gather((comm.rank, socket.gethostname(), str(Path(home).absolute()), seen))
    verdict = ""
    if comm.is_driver:
        probe.unlink(missing_ok=True)
        blind = [f"rank {rank} on {host} (home {path})" for rank, host, path, ok in answers if not ok]
        if blind:
            verdict = (
                f"run home: {', '.join(blind)} cannot see what rank 0 on {socket.gethostname()} wrote under "
                f"{Path(home).absolute()}: every node needs the run home on one shared volume (a ReadWriteMany "
                "claim, NFS, a parallel file system) at the same path (--home / $SAO_HOME); docs/production.md, "
                "'Beyond one node'"
            )
    verdict = comm.broadcast(verdict)
    if verdict:
        raise HomeStateError(verdict)
