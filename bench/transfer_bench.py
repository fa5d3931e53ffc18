"""Policy versions to external rollout servers: seconds per version and GB/s of the collective transport (buckets
over a gloo pair group per server) against the filesystem path (an HF directory written, its path posted, read
by each server), measured in one run (issue 27; components/rollout/transports.py, transfer.py).

`make bench BENCH=transfer`. Per model, two `sao engine serve` child processes (one torch thread each) and this
process as the trainer (one torch thread; gloo's and the writer's threads besides): on a 2-core machine the
three share both cores, as a trainer and its servers on one host would. The publishes go through `HttpRollouts`
as the trainer makes them (`publish` returns once both servers serve the version), one `HttpRollouts` per
transport over the same two servers; the collective one takes each bucket size in turn
(`rollout.transfer_bucket_mb`), on the one group per server it formed in the warm-up. After `--warmup` rounds,
`--versions` rounds each publish one version through every arm, the arms' order rotated round by round, so drift
on a shared machine hits them alike. Every version is new random weights (the model's own plus noise, a fresh
tensor per name), and the weights probe checks each one on both servers after its transfer (not timed).

Models: `tiny`, `tiny-cpu`'s policy built from its config (0.77M parameters, fp32), and `100m`, the same
Qwen3-MoE scaled to 106M parameters (fp32, 424 MB; saved with `save_model_dir`, started by the servers from it).

How to read the table: `s/version` is `rollout/transfer_s` (from `publish` to every server serving the version:
the filesystem arm's write included), median and min-max over the measured versions; `bytes/version` is
`rollout/publish_bytes`, the bytes the servers took in (the model's bytes twice, the collective's 16-byte
alignment included; the filesystem path also writes the model once, not counted); GB/s is their quotient
(GB = 1e9 bytes); `/ filesystem` divides an arm's median by the filesystem arm's of the same model and run.
On one host both paths are memory copies (the filesystem's through the page cache, the collective's over
loopback TCP), so this measures the transports' own overheads, not a network: docs/gpu.md ("Weight transfer")
does the arithmetic for a 30B policy over NVLink and InfiniBand. Below the table, per model: the warm-up round's
times (the collective's groups are formed in its first publish), and a bare gloo pair broadcast of the model's
bytes between two fresh processes, into a reused buffer (the loopback's floor) and into buffers allocated as the
transport allocates them, so the share of the collective arm's time that is neither the wire nor allocation shows.

Flags (or `BENCH_TRANSFER_*` variables under `make bench`): `--models tiny,100m`, `--versions 10`, `--warmup 1`,
`--buckets-mb 512,64`. The table and a JSON of every sample go to `$SAO_HOME/bench/` (default `.sao/bench/`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore
from transformers.utils import logging as hf_logging

from bench import report
from components.config import RolloutConfig, load_config
from components.models import build_policy, config_tokenizer, save_model_dir
from components.rollout.backends import HttpRollouts
from components.rollout.engine_process import EngineProcess, free_port
from components.rollout.pairs import broadcast, pair_group

SERVERS = 2
NOISE = 0.01
"""Scale of the noise each version adds to the model's weights (random weights per version, a sane model)."""
SCALED = {
    "hidden_size": 512,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 2,
    "num_experts": 8,
    "moe_intermediate_size": 1024,
}
"""`tiny-cpu`'s `[model]` scaled to about 100M parameters (106M with its character vocabulary)."""
MODELS = ("tiny", "100m")
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Not passed to the servers: a server must never take itself for a rank of a group this process joined."""


def _env_list(name: str, default: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in os.environ.get(name, default).split(",") if x.strip())


def _model(name: str):
    """(label, model, tokenizer) of `name`, built from `tiny-cpu`'s config (scaled for `100m`), fp32."""
    cfg = load_config("tiny-cpu").model
    if name == "100m":
        cfg = dataclasses.replace(cfg, **SCALED)
    elif name != "tiny":
        raise SystemExit(f"unknown model {name!r}; known: {list(MODELS)}")
    tokenizer = config_tokenizer(cfg.tokenizer)
    model = build_policy(cfg, tokenizer).eval()
    return ("tiny-cpu (Qwen3-MoE)" if name == "tiny" else "100M Qwen3-MoE"), model, tokenizer


def _version(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """New weights: every floating tensor of `base` plus noise, as a fresh tensor (nothing shared between versions)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (v + NOISE * torch.randn(v.shape, generator=gen, dtype=v.dtype)) if v.is_floating_point() else v.clone()
        for k, v in base.items()
    }


def _arm_label(bucket_mb: int | None) -> str:
    return "filesystem" if bucket_mb is None else f"collective, {bucket_mb} MB buckets"


async def _measure(urls, model, tokenizer, publish_dir: Path, versions: int, warmup: int, buckets_mb) -> list[dict]:
    """Publish `warmup + versions` rounds through every arm; per arm, its samples."""
    rc = RolloutConfig(backend="http", urls=tuple(urls), probe_every=1, transfer_timeout_s=120.0)
    files = HttpRollouts(rc, model, tokenizer, publish_dir)
    await files.start()  # both servers serve the trainer's weights as v0 (read from publish_dir/v00000000)
    collective_rc = dataclasses.replace(
        rc, weight_transfer="collective", transfer_bucket_mb=buckets_mb[0], transfer_fallback=False
    )
    collective = HttpRollouts(collective_rc, model, tokenizer, publish_dir)
    # v0 is what both servers serve already: nothing is sent until its first version, which forms the groups
    await collective.start()
    arms = [{"arm": _arm_label(None), "bucket_mb": None, "rollouts": files}] + [
        {"arm": _arm_label(mb), "bucket_mb": mb, "rollouts": collective} for mb in buckets_mb
    ]
    for arm in arms:
        arm.update(warmup_s=[], seconds=[], bytes=[], written=[])
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    version, probe = 0, 0.0
    try:
        for round_ in range(warmup + versions):
            shift = round_ % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                version += 1
                weights = _version(base, seed=version)
                rollouts = arm["rollouts"]
                if arm["bucket_mb"] is not None:
                    rollouts.transport.bucket_bytes = arm["bucket_mb"] * 2**20  # the next version's plan
                await rollouts.publish(weights, version)
                metrics = rollouts.metrics()
                probe = max(probe, metrics["rollout/probe_max_abs_diff"])  # this version's probe, both servers
                if round_ < warmup:
                    arm["warmup_s"].append(metrics["rollout/transfer_s"])
                    continue
                arm["seconds"].append(metrics["rollout/transfer_s"])
                arm["bytes"].append(int(metrics["rollout/publish_bytes"]))
                written = publish_dir / f"v{version:08d}"
                arm["written"].append(sum(f.stat().st_size for f in written.iterdir()) if written.is_dir() else 0)
        for rollouts in (files, collective):
            metrics = rollouts.metrics()
            if metrics["rollout/probe_failures"] or metrics.get("rollout/transfer_fallbacks", 0):
                raise RuntimeError(f"a version did not arrive as sent: {metrics}")
        retries = int(collective.metrics()["rollout/transfer_retries"])
    finally:
        await files.close()
        await collective.close()
    out = []
    for arm in arms:
        arm.pop("rollouts")
        out.append({**arm, "collective_retries": retries, "probe_max_abs_diff": probe})
    return out


def _floor_rank(rank: int, port: int, nbytes: int, repeats: int, results) -> None:
    """One side of a bare gloo pair: `nbytes` broadcast `repeats` times into one reused buffer, then into a buffer
    allocated each time as the transport allocates them (zeroed to pack on the sender, empty on the receiver, the
    allocation timed); rank 0 reports the median seconds of each."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, None, rank == 0, timeout=datetime.timedelta(seconds=60))
    group = pair_group(store, "floor", rank, "gloo", "127.0.0.1", 60.0)
    reused = torch.zeros(nbytes, dtype=torch.uint8)
    times: dict[str, list[float]] = {"reused": [], "fresh": []}
    for kind in ("reused", "reused", "fresh"):  # the first pass warms the pair up
        for _ in range(repeats):
            began = time.perf_counter()
            if kind == "reused":
                buffer = reused
            else:
                buffer = torch.zeros(nbytes, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
            broadcast(group, buffer)
            times[kind].append(time.perf_counter() - began)
    if rank == 0:
        results.put({kind: statistics.median(t[-repeats:]) for kind, t in times.items()})


def floor(nbytes: int, repeats: int = 3) -> dict[str, float]:
    """Median seconds of a bare gloo broadcast of `nbytes` between two processes of one thread: into a reused
    buffer (the wire's floor on this host) and into buffers allocated as the transport does (the allocation's
    share)."""
    results = mp.get_context("spawn").Queue()
    mp.spawn(_floor_rank, args=(free_port(), nbytes, repeats, results), nprocs=2, join=True)
    return results.get()


def _time_model(name: str, work: Path, versions: int, warmup: int, buckets_mb) -> dict:
    label, model, tokenizer = _model(name)
    model_dir = save_model_dir(model, tokenizer, work / name / "model")
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    engines = [
        EngineProcess(model_dir, threads=1, log=work / name / f"engine-{i}.log", env=env).start(wait=False)
        for i in range(SERVERS)
    ]
    try:
        for engine in engines:
            engine.wait_healthy()
        arms = asyncio.run(
            _measure(
                [e.url for e in engines], model, tokenizer, work / name / "published", versions, warmup, buckets_mb
            )
        )
    finally:
        for engine in engines:
            engine.kill()
    state = {t.data_ptr(): t for t in model.state_dict().values()}
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "model": name,
        "label": label,
        "params": sum(p.numel() for p in model.parameters()),
        "model_bytes": model_bytes,
        "arms": arms,
        "gloo_floor_s": floor(model_bytes),
    }


def _summarise(result: dict) -> None:
    """Median, min-max, bytes, GB/s and the ratio to the filesystem arm, added to each arm of `result`."""
    for model in result["models"]:
        baseline = None
        for arm in model["arms"]:
            s = arm["seconds"]
            arm["median_s"], arm["min_s"], arm["max_s"] = statistics.median(s), min(s), max(s)
            arm["bytes_per_version"] = int(statistics.median(arm["bytes"]))
            arm["gb_per_s"] = arm["bytes_per_version"] / 1e9 / arm["median_s"]
            baseline = baseline if baseline is not None else arm["median_s"]  # the filesystem arm comes first
            arm["vs_filesystem"] = arm["median_s"] / baseline


def _cpu() -> str:
    """The CPU's model name (Linux), else the architecture."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def _size(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def table(result: dict) -> str:
    """The markdown table of a summarised `result`."""
    lines = [
        "| model | params | arm | s/version, median | min-max | bytes/version | GB/s | / filesystem |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in result["models"]:
        for i, arm in enumerate(model["arms"]):
            label, params = (model["label"], f"{model['params'] / 1e6:.2f}M") if i == 0 else ("", "")
            lines.append(
                f"| {label} | {params} | {arm['arm']} | {arm['median_s']:.3f} | {arm['min_s']:.3f}-{arm['max_s']:.3f} "
                f"| {_size(arm['bytes_per_version'])} | {arm['gb_per_s']:.2f} | {arm['vs_filesystem']:.2f}x |"
            )
    return "\n".join(lines)


def run(
    models: tuple[str, ...] | None = None,
    versions: int | None = None,
    warmup: int | None = None,
    buckets_mb: tuple[int, ...] | None = None,
    out: Path | None = None,
) -> dict:
    """Time every model's arms; print the table and write it with the samples under `out`; returns the result."""
    models = models or _env_list("BENCH_TRANSFER_MODELS", ",".join(MODELS))
    versions = versions if versions is not None else int(os.environ.get("BENCH_TRANSFER_VERSIONS", "10"))
    warmup = warmup if warmup is not None else int(os.environ.get("BENCH_TRANSFER_WARMUP", "1"))
    buckets_mb = buckets_mb or tuple(int(b) for b in _env_list("BENCH_TRANSFER_BUCKETS_MB", "512,64"))
    out = report.out_dir(out)
    if versions < 1 or not buckets_mb:
        raise SystemExit("versions: at least 1; buckets_mb: at least one bucket size")
    threads, bars = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(1)  # the trainer's share, as each server's
    hf_logging.disable_progress_bar()  # save_pretrained's bar, once per filesystem version
    header = report.Header(_cpu())
    try:
        with tempfile.TemporaryDirectory(prefix="transfer-bench-") as work:
            timed = [_time_model(name, Path(work), versions, warmup, tuple(buckets_mb)) for name in models]
    finally:
        torch.set_num_threads(threads)
        if bars:
            hf_logging.enable_progress_bar()
    result = {
        **header.fields(),
        "versions": versions,
        "warmup": warmup,
        "servers": SERVERS,
        "models": timed,
    }
    _summarise(result)
    text = table(result)
    print(
        f"\n== weight transfer to {SERVERS} sao engine servers: {versions} versions an arm after {warmup} of warm-up, "
        f"arms interleaved; load average {header.load[0]:.2f} at the start, {result['load_average_at_end'][0]:.2f} at the end =="
    )
    print(text)
    for model in result["models"]:
        first = ", ".join(f"{arm['arm']} {arm['warmup_s'][0]:.3f} s" for arm in model["arms"] if arm["warmup_s"])
        if first:
            print(f"  {model['label']}: warm-up round (the collective's groups formed in its first publish): {first}")
        print(
            f"  {model['label']}: weights probe max |diff| {model['arms'][0]['probe_max_abs_diff']:.2g}, "
            f"collective retries {model['arms'][0]['collective_retries']}"
        )
        bare = model["gloo_floor_s"]
        print(
            f"  {model['label']}: a bare gloo pair broadcast of the model's {_size(model['model_bytes'])} takes "
            f"{bare['reused']:.3f} s into a reused buffer, {bare['fresh']:.3f} s allocating it as the transport does "
            "(one server; a floor for each of the collective's two)"
        )
    report.write(out, "transfer", text, result)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help=f"comma-separated, of {list(MODELS)} (default: both)")
    parser.add_argument("--versions", type=int, default=None, help="measured versions an arm (default 10)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up versions an arm (default 1)")
    parser.add_argument("--buckets-mb", default=None, help="collective bucket sizes in MB (default 512,64)")
    parser.add_argument("--out", type=Path, default=None, help="where the table and JSON go (default .sao/bench)")
    args = parser.parse_args(argv)
    run(
        tuple(args.models.split(",")) if args.models else None,
        args.versions,
        args.warmup,
        tuple(int(b) for b in args.buckets_mb.split(",")) if args.buckets_mb else None,
        args.out,
    )


if __name__ == "__main__":
    main()
