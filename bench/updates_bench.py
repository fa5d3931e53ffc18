"""Weight updates under heavy-tailed lengths: continuing the sequences in flight on the new weights (the embedded
engine's way: their caches recomputed, each token tagged with its version) against draining them first (vLLM's load
gate: no sequence admitted until every one in flight has finished), on one engine, in one run (issue 44).

`make bench BENCH=updates`. The embedded engine (`tiny-cpu`'s policy, one torch thread, `--slots` sequences at
most) is kept full: a client submits a new request the moment one finishes, each with a length drawn from a Pareto
distribution (`--alpha`, from `--min-tokens`, capped at `--max-tokens`; stop tokens off, so a request runs to its
length), the same draws in both arms. Every `--period` seconds a new version is loaded. An arm runs `--seconds`;
the two alternate, twice each.

How to read it: each figure is the median of the arm's two runs; tokens/s is sampled tokens over the wall time; `slots idle` is the share of the batch's
slots that sampled nothing, over the engine's steps (1 - tokens / (steps x slots)); `recomputed` is the context
tokens the continuing arm recomputed after updates; `continue / arm` divides the continuing arm's tokens/s by the arm's.
With lengths this uneven, a drain waits for the longest sequence in flight while the other slots stay empty.

Flags (or `BENCH_UPDATES_*` under `make bench`): `--seconds 20`, `--period 1.0`, `--slots 16`, `--alpha 1.2`,
`--min-tokens 8`, `--max-tokens 384`. The table and a JSON go to `$SAO_HOME/bench/` (default `.sao/bench/`).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from pathlib import Path

import torch

from bench import report
from components.config import load_config
from components.models import build_policy, config_tokenizer
from components.rollout.embedded import EmbeddedEngine
from components.rollout.protocol import SamplingRequest


def pareto_lengths(n: int, alpha: float, low: int, high: int, seed: int = 0) -> list[int]:
    """`n` lengths from a Pareto(alpha) tail starting at `low`, capped at `high`."""
    rng = random.Random(seed)
    return [min(high, int(low * rng.paretovariate(alpha))) for _ in range(n)]


def _arm(model, tokenizer, drain: bool, seconds: float, period: float, slots: int, lengths: list[int]) -> dict:
    engine = EmbeddedEngine(model, tokenizer, max_batch=slots, threads=1).start()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = tokenizer("<|user|>Compute 12*34+5.<|assistant|>")["input_ids"]
    draws = iter(lengths)
    done = threading.Event()
    lock = threading.Lock()

    def submit(_=None) -> None:
        with lock:
            if done.is_set():
                return
            n = next(draws)
        engine.submit(SamplingRequest(prompt, max_tokens=n, seed=n)).add_done_callback(submit)

    try:
        for _ in range(slots):
            submit()
        began, stats0, version = time.perf_counter(), _counts(engine), 0
        while time.perf_counter() - began < seconds:
            time.sleep(period)
            version += 1
            engine.load_weights(weights, version, drain=drain)
        stats1 = _counts(engine)
        wall = time.perf_counter() - began
        done.set()
    finally:
        engine.shutdown()
    tokens, steps = stats1["tokens"] - stats0["tokens"], stats1["steps"] - stats0["steps"]
    return {
        "mode": "drain" if drain else "continue",
        "seconds": wall,
        "tokens": tokens,
        "steps": steps,
        "tokens_per_s": tokens / wall,
        "slots_idle": 1 - tokens / (steps * slots),
        "updates_applied": stats1["updates"] - stats0["updates"],
        "recomputed": stats1["recomputed"] - stats0["recomputed"],
    }


def _counts(engine: EmbeddedEngine) -> dict[str, int]:
    s = engine.stats
    return {
        "tokens": s.generated_tokens,
        "steps": s.steps,
        "updates": s.weight_updates,
        "recomputed": s.recompute_tokens,
    }


def table(result: dict) -> str:
    lines = [
        "| arm | tokens/s, median | slots idle | updates applied | recomputed tokens | continue / arm |",
        "|---|---|---|---|---|---|",
    ]
    for arm in result["arms"]:
        lines.append(
            f"| {arm['mode']} | {arm['tokens_per_s']:.0f} | {arm['slots_idle']:.1%} | {arm['updates_applied']:g} "
            f"| {arm['recomputed']:,.0f} | {arm['vs_continue']:.2f}x |"
        )
    return "\n".join(lines)


def run(
    seconds: float | None = None,
    period: float | None = None,
    slots: int | None = None,
    alpha: float | None = None,
    min_tokens: int | None = None,
    max_tokens: int | None = None,
    out: Path | None = None,
) -> dict:
    env = os.environ.get
    seconds = seconds or float(env("BENCH_UPDATES_SECONDS", "20"))
    period = period or float(env("BENCH_UPDATES_PERIOD", "1.0"))
    slots = slots or int(env("BENCH_UPDATES_SLOTS", "16"))
    alpha = alpha or float(env("BENCH_UPDATES_ALPHA", "1.2"))
    min_tokens = min_tokens or int(env("BENCH_UPDATES_MIN_TOKENS", "8"))
    max_tokens = max_tokens or int(env("BENCH_UPDATES_MAX_TOKENS", "384"))
    out = report.out_dir(out)
    cfg = load_config("tiny-cpu").model
    tokenizer = config_tokenizer(cfg.tokenizer)
    model = build_policy(cfg, tokenizer, seed=0).eval()
    lengths = pareto_lengths(100_000, alpha, min_tokens, max_tokens)
    threads = torch.get_num_threads()
    header = report.Header()
    runs: dict[str, list[dict]] = {"continue": [], "drain": []}
    try:
        for drain in (False, True, True, False):
            arm = _arm(model, tokenizer, drain, seconds, period, slots, lengths)
            runs[arm["mode"]].append(arm)
    finally:
        torch.set_num_threads(threads)
    numbers = ("tokens_per_s", "slots_idle", "updates_applied", "recomputed")
    arms = [
        {"mode": mode, **{k: statistics.median(a[k] for a in samples) for k in numbers}, "runs": samples}
        for mode, samples in runs.items()
    ]
    for arm in arms:
        arm["vs_continue"] = arms[0]["tokens_per_s"] / arm["tokens_per_s"]
    result = {
        **header.fields(),
        "settings": {
            "seconds": seconds,
            "period": period,
            "slots": slots,
            "alpha": alpha,
            "min_tokens": min_tokens,
            "max_tokens": max_tokens,
            "mean_length": statistics.mean(lengths),
            "median_length": statistics.median(lengths),
        },
        "arms": arms,
    }
    text = table(result)
    print(
        f"\n== weight updates every {period:g} s on an engine of {slots} slots, lengths Pareto({alpha:g}) from "
        f"{min_tokens} capped at {max_tokens} (mean {statistics.mean(lengths):.0f}, median "
        f"{statistics.median(lengths):.0f}): {seconds:g} s an arm, twice each; load average {header.load[0]:.2f} at the "
        f"start, {result['load_average_at_end'][0]:.2f} at the end =="
    )
    print(text)
    report.write(out, "updates", text, result)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, kind in (
        ("--seconds", float),
        ("--period", float),
        ("--slots", int),
        ("--alpha", float),
        ("--min-tokens", int),
        ("--max-tokens", int),
    ):
        parser.add_argument(flag, type=kind, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    run(args.seconds, args.period, args.slots, args.alpha, args.min_tokens, args.max_tokens, args.out)


if __name__ == "__main__":
    main()
