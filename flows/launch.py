"""The command of a GPU job on one node or several: `python -m flows.launch [options] [-m module args...]`.

It runs torchrun on this node (replacing its own process), with the run's entry point after it: `-m flows.ranks` by
default, the flow run the Prefect worker started (flows/ranks.py). One node is `torchrun --standalone`. Several
nodes form one world through torch elastic's c10d rendezvous, hosted by node 0's agent:

    python -m flows.launch --nnodes 4 --nproc-per-node 8        # on each of the four nodes

    --nnodes N           nodes in the job (`$SAO_NNODES`, default 1)
    --nproc-per-node P   ranks on this node, one per GPU (`$SAO_NPROC_PER_NODE`, default torchrun's `gpu`)
    --node-index I       this node's place, 0 .. N-1 (`$SAO_NODE_INDEX`, else a Kubernetes indexed Job's
                         `$JOB_COMPLETION_INDEX`): node 0 hosts the rendezvous
    --rdzv-endpoint H:P  node 0's address (`$SAO_RDZV_ENDPOINT`); in an indexed Job with a `subdomain` it is derived:
                         the pod's fully qualified name with its own index replaced by 0, port 29400
    --rdzv-id ID         one id per job (`$SAO_RDZV_ID`, else the flow run's `$PREFECT__FLOW_RUN_ID`)

Which node's first process becomes the run's rank 0 (the driver) is the rendezvous's choice; nothing depends on it.
Every node must see the same run home (a shared volume), which the stages check as they start
(components/stages/nodes.py). docs/production.md, "Beyond one node", has the Kubernetes and Docker launches.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

DEFAULT_TARGET = ["-m", "flows.ranks"]
RDZV_PORT = 29400
"""The rendezvous port on node 0 (torch elastic's customary one); the NetworkPolicy of infra/k8s/train.yaml admits
the job's pods to it."""


class LaunchError(ValueError):
    """A launch that cannot form its world, named by the option or variable at fault."""


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m flows.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nnodes", type=int, default=int(env("SAO_NNODES", "1")))
    p.add_argument("--nproc-per-node", default=env("SAO_NPROC_PER_NODE", "gpu"))
    p.add_argument("--node-index", type=int, default=_int_env("SAO_NODE_INDEX", "JOB_COMPLETION_INDEX"))
    p.add_argument("--rdzv-endpoint", default=env("SAO_RDZV_ENDPOINT"))
    p.add_argument("--rdzv-id", default=env("SAO_RDZV_ID") or env("PREFECT__FLOW_RUN_ID"))
    return p


def _int_env(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise LaunchError(f"${name}: {value!r} is not a node index") from None
    return None


def indexed_job_endpoint(fqdn: str, index: int, port: int = RDZV_PORT) -> str:
    """Node 0's rendezvous address in a Kubernetes indexed Job: its pods are named `<job>-<index>` and, with a
    `subdomain`, resolve as `<job>-<index>.<subdomain>.<namespace>.svc...`; this pod's name with 0 for its index."""
    host, _, domain = fqdn.partition(".")
    suffix = f"-{index}"
    if not host.endswith(suffix) or not domain:
        raise LaunchError(
            f"--rdzv-endpoint: not given, and this host's name {fqdn!r} is not an indexed Job's pod "
            f"'<job>-{index}.<subdomain>...' (set the Job's spec.template.spec.subdomain to a headless Service)"
        )
    return f"{host[: -len(suffix)]}-0.{domain}:{port}"


def torchrun_args(
    nnodes: int,
    nproc_per_node: str,
    node_index: int | None,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    target: list[str],
    fqdn: str = "",
) -> list[str]:
    """torchrun's arguments for this node (after `python -m torch.distributed.run`)."""
    if nnodes < 1:
        raise LaunchError(f"--nnodes: must be >= 1, got {nnodes}")
    if not (nproc_per_node == "gpu" or nproc_per_node.isdigit() and int(nproc_per_node) >= 1):
        raise LaunchError(f"--nproc-per-node: a count >= 1 or 'gpu', got {nproc_per_node!r}")
    ranks = ["--nproc-per-node", nproc_per_node]
    if nnodes == 1:
        return ["--standalone", *ranks, *target]
    if node_index is None:
        raise LaunchError("--node-index: required with --nnodes > 1 ($SAO_NODE_INDEX, or an indexed Job's)")
    if not 0 <= node_index < nnodes:
        raise LaunchError(f"--node-index: {node_index} is not a node of {nnodes} (0 .. {nnodes - 1})")
    if not rdzv_id:
        raise LaunchError("--rdzv-id: required with --nnodes > 1 ($SAO_RDZV_ID, or the flow run's id)")
    endpoint = rdzv_endpoint or indexed_job_endpoint(fqdn or socket.getfqdn(), node_index)
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise LaunchError(f"--rdzv-endpoint: expected HOST:PORT, got {endpoint!r}")
    return [
        *("--nnodes", str(nnodes), *ranks),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id),
        # node 0's agent hosts the rendezvous store: said, not guessed from host names (a pod's name may not match
        # the address others reach it by, and on one machine every agent's would)
        *("--rdzv-conf", f"is_host={'true' if node_index == 0 else 'false'}"),
        *target,
    ]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("-m") if "-m" in argv else len(argv)
    options, target = argv[:split], argv[split:] or DEFAULT_TARGET
    try:
        args = _parser().parse_args(options)
        tail = torchrun_args(
            args.nnodes, str(args.nproc_per_node), args.node_index, args.rdzv_endpoint, args.rdzv_id, target
        )
    except LaunchError as exc:
        print(f"sao: launch: {exc}", file=sys.stderr)
        sys.exit(2)
    command = [sys.executable, "-m", "torch.distributed.run", *tail]
    print("sao: launch:", " ".join(command), file=sys.stderr, flush=True)
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
