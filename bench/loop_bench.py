"""The preset's RL loop, where its time goes, and how far it is from the hardware's bound (issue 14).

`make bench BENCH=loop`. Each arm runs `components.training.rl.trainer.train` on the `tiny-cpu` preset (its SFT
policy, built first if missing) in a fresh process, so arms do not share warm caches or threads:

- `sao async`: the preset as `make run` trains it (16 trajectories per update, one rollout per prompt).
- `grpo sync`: synchronous GRPO, 8 prompts x a group of 8 = 64 episodes in flight, generate then train.

Each arm runs twice when `BENCH_BASE` names a git revision (default: `BENCH_BASE=HEAD`, the last commit): once
on that revision's code (a `git worktree` under `.sao/bench-base`, made once) and once on the working tree,
in the same run, so the ratio is between two codes on the same machine at the same time. Rates are over the
wall clock of the measured steps (after `WARMUP` steps): trajectories trained on, and their generated (action)
tokens.

For the working tree, each step's time is broken down: the trainer's wait for a batch, the critic's K updates,
the policy update, weight publishing, and the rest (logging, checkpoints); the engine thread's decode, prefill
of new requests (a turn's context: prompt, earlier turns, tool observations), recompute of in-flight caches
after a weight update, sampling, loading weights; the tool calls (the sandbox); the CPU a step took (the whole
machine's from /proc/stat, this process's, the rest: the sandbox's processes), and for the trainer's and the
engine's threads how their wall time splits into running on a core, waiting for one (the scheduler's run-queue
delay) and the rest (the GIL, I/O). Next to it, the bound: the
time `model.generate` needs for the same generated tokens on a static batch, plus the bare forward and backward
passes of the same batch that the algorithm needs (the policy once; SAO's critic K times, and once more forward for
the advantages), each on all cores.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEPS = int(os.environ.get("BENCH_LOOP_STEPS", "40"))
WARMUP = 5
ARMS = {
    "sao async": ['train.algo="sao"', "train.sync=false"],
    "grpo sync": [
        'train.algo="grpo"',
        "train.sync=true",
        "train.group_size=8",
        "train.batch_size=64",
        "rollout.concurrency=64",
    ],
}
COMMON = ["train.checkpoint_every=0", 'train.collapse_guard="off"']


# ---- one arm, in its own process (imports `components` from whichever tree PYTHONPATH names) ------------------


def probe(arm: str, steps: int, home: Path) -> dict:
    """Run `arm` for `steps` updates in this process; per-step wall times and token counts, the trainer's own
    timing metrics, the embedded engine's phase times, the tools' time, and the CPU and run-queue time of the
    learner's and the engine's threads. The loop is watched through its own seams: an observer of every step
    (`train(on_step=...)`) and an environment that times its steps; nothing of the trainer is replaced."""
    import tempfile
    from dataclasses import replace

    from components.config import load_config
    from components.envs.registry import build_env
    from components.stages.sft import run_sft
    from components.tracking import NullTracker
    from components.training.rl.trainer import train

    cfg = load_config("tiny-cpu", COMMON + ARMS[arm] + [f"train.max_steps={steps}"])
    sft_dir = run_sft(load_config("tiny-cpu"), home, log=lambda _: None)
    setup = build_env(cfg)
    tools = TimedEnvironment(setup.env)
    rows: list[dict] = []
    totals = {"trainer_s": 0.0}

    def observe(trainer, batch, row) -> None:
        engine = getattr(trainer.parts.rollouts, "engine", None)
        totals["trainer_s"] += row["trainer/step_s"]
        critic = trainer.parts.learner.critic
        counters = {
            "tool_s": tools.seconds,
            "tool_calls": tools.calls,
            "critic_s": critic.busy_s if critic else 0.0,
            "trainer_s": totals["trainer_s"],
        }
        counters.update(_thread_counters("trainer", trainer.learner_thread_id))
        stats = getattr(engine, "stats", None)
        if stats is not None:
            engine_wall = stats.decode_s + stats.prefill_s + stats.sample_s + stats.update_s
            counters.update({"engine_s": engine_wall, **_thread_counters("engine", engine.thread_id)})
        rows.append(
            {
                "n": len(batch),
                "tokens": sum(t.num_actions for t in batch),
                "t": time.perf_counter(),
                "counters": counters,
                "cpu": cpu_seconds(),
                "engine": dict(vars(stats)) if stats else {},
                **{k: v for k, v in row.items() if k.startswith(("trainer/", "rollout/"))},
            }
        )

    with tempfile.TemporaryDirectory() as run_home:
        train(
            cfg,
            replace(setup, env=tools),
            sft_dir,
            Path(run_home),
            NullTracker(),
            log=lambda _: None,
            on_step=[observe],
        )
    import components

    return {"arm": arm, "rows": rows, "code": str(Path(components.__file__).parent.parent)}


class TimedEnvironment:
    """An environment that counts its episodes' steps (the tool calls) and their wall time, around another."""

    def __init__(self, env) -> None:
        self.env, self.seconds, self.calls = env, 0.0, 0
        self.name, self.success_threshold = env.name, env.success_threshold

    def start(self, task):
        return _TimedEpisode(self, self.env.start(task))


class _TimedEpisode:
    def __init__(self, owner: TimedEnvironment, episode) -> None:
        self.owner, self.episode = owner, episode

    def prompt(self):
        return self.episode.prompt()

    async def step(self, turn, truncated: bool):
        began = time.perf_counter()
        try:
            return await self.episode.step(turn, truncated)
        finally:
            self.owner.seconds += time.perf_counter() - began
            self.owner.calls += 1


def _thread_counters(key: str, thread_id: int | None) -> dict:
    """`<key>_cpu_s` and `<key>_queued_s`: the thread's time on a core and waiting for one (its run queue), from
    /proc/self/task/<id>/schedstat; nothing when the thread is not known yet."""
    if thread_id is None:
        return {}
    try:
        with open(f"/proc/self/task/{thread_id}/schedstat") as stat:
            on_cpu, queued = (int(x) / 1e9 for x in stat.read().split()[:2])
    except OSError:
        return {}
    return {f"{key}_cpu_s": on_cpu, f"{key}_queued_s": queued}


def cpu_seconds() -> dict:
    """CPU seconds so far: this process's (all its threads: trainer and engine) and the whole machine's busy time
    (every core, from /proc/stat: the sandbox's processes and anything else running)."""
    own = os.times()
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return {"process": own.user + own.system, "machine": (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")}


def _rates(rows: list[dict]) -> dict:
    measured = rows[WARMUP:]
    seconds = measured[-1]["t"] - rows[WARMUP - 1]["t"]
    return {
        "traj_per_s": sum(r["n"] for r in measured) / seconds,
        "tokens_per_s": sum(r["tokens"] for r in measured) / seconds,
        "step_s": seconds / len(measured),
        "seconds": seconds,
        "steps": len(measured),
    }


def _run_arm(arm: str, tree: Path, home: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # Each tree's own probe: a base revision is watched with its own code (its API may differ from this one's).
    out = subprocess.run(
        [
            sys.executable,
            str(tree / "bench" / "loop_bench.py"),
            "--probe",
            arm,
            "--steps",
            str(STEPS),
            "--home",
            str(home),
        ],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"bench loop: arm {arm!r} in {tree} failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if Path(result["code"]).resolve() != tree.resolve():
        raise SystemExit(f"bench loop: arm {arm!r} ran the code in {result['code']}, not {tree}")
    result.update(_rates(result["rows"]))
    return result


def _base_tree(rev: str) -> Path:
    """A worktree of `rev` under .sao/bench-base (re-pointed when `rev` moved)."""
    tree = REPO / ".sao" / "bench-base"
    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    if tree.exists():
        subprocess.run(["git", "checkout", "-q", "--detach", sha], cwd=tree, check=True)
    else:
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), sha], cwd=REPO, check=True)
    return tree


# ---- the breakdown and the bound ----------------------------------------------------------------------------


def _delta(rows: list[dict], path: tuple[str, ...]) -> float:
    def get(r):
        value = r
        for key in path:
            value = value.get(key, 0.0) if isinstance(value, dict) else 0.0
        return float(value)

    return (get(rows[-1]) - get(rows[WARMUP - 1])) / (len(rows) - WARMUP)


def breakdown(result: dict) -> list[tuple[str, float]]:
    """Per-step seconds of each part, averaged over the measured steps."""
    rows = result["rows"][WARMUP:]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    wait, step, publish = (mean(k) for k in ("trainer/wait_s", "trainer/step_s", "trainer/publish_s"))
    critic = _delta(result["rows"], ("counters", "critic_s"))
    parts = [
        ("trainer: waiting for a batch", wait),
        ("trainer: critic, K updates", critic),
        ("trainer: policy update", step - critic),
        ("trainer: publishing weights", publish),
        ("trainer: logging, checkpoints, other", result["step_s"] - wait - step - publish),
    ]
    all_rows = result["rows"]
    if all_rows[-1]["engine"]:
        for name, key in (
            ("decode", "decode_s"),
            ("prefill of new requests", "prefill_s"),
            ("sampling", "sample_s"),
            ("loading weights", "update_s"),
        ):
            parts.append((f"engine: {name}", _delta(all_rows, ("engine", key))))
        new, redo = _delta(all_rows, ("engine", "prefill_tokens")), _delta(all_rows, ("engine", "recompute_tokens"))
        parts.append((f"engine: prefill tokens per step: {new:.0f} new, {redo:.0f} recomputed after updates", 0.0))
    if "cpu" in all_rows[-1]:
        process, machine = _delta(all_rows, ("cpu", "process")), _delta(all_rows, ("cpu", "machine"))
        parts.append(
            (
                f"CPU per step: {machine * 1000:.0f} ms busy on the machine ({machine / result['step_s']:.2f} of "
                f"{os.cpu_count()} cores), {process * 1000:.0f} ms in this process (trainer, engine), "
                f"{(machine - process) * 1000:.0f} ms elsewhere (the sandbox's processes)",
                0.0,
            )
        )
    for key, what in (("trainer", "the learner step"), ("engine", "the engine's steps")):
        if f"{key}_s" in all_rows[-1]["counters"]:
            wall, cpu, queued = (_delta(all_rows, ("counters", f"{key}_{part}")) for part in ("s", "cpu_s", "queued_s"))
            parts.append(
                (
                    f"{key} thread, in {what}: {wall * 1000:.0f} ms = {cpu * 1000:.0f} ms on a core + "
                    f"{queued * 1000:.0f} ms waiting for one + {(wall - cpu - queued) * 1000:.0f} ms for the "
                    f"GIL or I/O",
                    0.0,
                )
            )
    calls = _delta(all_rows, ("counters", "tool_calls"))
    parts.append(
        (
            f"tools: {calls:.1f} env steps per step, "
            f"{1000 * _delta(all_rows, ('counters', 'tool_s')) / max(calls, 1e-9):.1f} ms each (wall, concurrent)",
            _delta(all_rows, ("counters", "tool_s")),
        )
    )
    return parts


def bound(result: dict, home: Path) -> dict:
    """Seconds per step of the same work with no overhead: `model.generate` of the step's generated tokens on a
    static batch, plus the bare passes the arm's algorithm needs on the same batch: the policy's forward and
    backward, and with a critic (SAO) its K forwards and backwards and the updated critic's forward for the
    advantages (V_old shares the first update's forward)."""
    import torch

    from components.config import load_config
    from components.models import ValueModel, load_policy, token_logprobs
    from components.stages.sft import run_sft
    from components.training.rl.algorithms import ALGORITHMS

    rows = result["rows"][WARMUP:]
    batch = round(statistics.fmean(r["n"] for r in rows))
    new_tokens = max(1, round(statistics.fmean(r["tokens"] for r in rows) / batch))
    length = max(2, round(statistics.fmean(r["rollout/length_mean"] for r in rows)))
    cfg = load_config("tiny-cpu")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    policy = load_policy(run_sft(cfg, home, log=lambda _: None))
    critic = ValueModel.from_policy(policy)
    prompt = torch.randint(10, policy.config.vocab_size, (batch, max(1, length - new_tokens)))

    def generate() -> None:
        with torch.no_grad():
            policy.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )

    ids = torch.randint(10, policy.config.vocab_size, (batch, length))
    mask = torch.ones_like(ids)

    uses_critic = ALGORITHMS[load_config("tiny-cpu", ARMS[result["arm"]]).train.algo].uses_critic

    def forward_backward() -> None:
        token_logprobs(policy, ids, 1.0, mask).sum().backward()
        if uses_critic:
            for _ in range(cfg.algo.critic_updates):
                critic(ids, mask).sum().backward()
            with torch.no_grad():
                critic(ids, mask)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    gen, train = timed(generate), timed(forward_backward)
    passes = f"policy fwd+bwd, critic {cfg.algo.critic_updates} x fwd+bwd + fwd" if uses_critic else "policy fwd+bwd"
    return {
        "generate_s": gen,
        "train_s": train,
        "step_s": gen + train,
        "batch": batch,
        "passes": passes,
        "new_tokens": new_tokens,
        "length": length,
    }


def run() -> None:
    home = Path(os.environ.get("SAO_HOME", REPO / ".sao")).resolve()
    base_rev = os.environ.get("BENCH_BASE", "HEAD")
    from components.config import load_config
    from components.stages.sft import run_sft

    run_sft(load_config("tiny-cpu"), home, log=lambda line: print(f"  {line}", flush=True))
    base = _base_tree(base_rev) if base_rev else None
    print(
        f"loop: tiny-cpu preset, {STEPS} updates per arm ({WARMUP} warm-up), {os.cpu_count()} cores; base "
        f"{base_rev or '(none)'}",
        flush=True,
    )
    for arm in ARMS:
        now = _run_arm(arm, REPO, home)
        line = (
            f"  {arm:<10} now : {now['traj_per_s']:6.1f} traj/s {now['tokens_per_s']:7.0f} tokens/s "
            f"{now['step_s'] * 1000:6.0f} ms/step"
        )
        if base is not None:
            old = _run_arm(arm, base, home)
            line += (
                f" | base: {old['traj_per_s']:6.1f} traj/s {old['tokens_per_s']:7.0f} tokens/s | now/base "
                f"{now['traj_per_s'] / old['traj_per_s']:.2f}x traj/s, "
                f"{now['tokens_per_s'] / old['tokens_per_s']:.2f}x tokens/s"
            )
        print(line, flush=True)
        for name, seconds in breakdown(now):
            print(f"      {name:<44} {seconds * 1000:7.1f} ms" if seconds else f"      {name}", flush=True)
        limit = bound(now, home)
        print(
            f"      bound: generate {limit['batch']}x{limit['new_tokens']} tokens {limit['generate_s'] * 1000:.0f} ms"
            f" + {limit['passes']} ({limit['batch']}x{limit['length']}) {limit['train_s'] * 1000:.0f} ms = "
            f"{limit['step_s'] * 1000:.0f} ms/step; loop / bound = {now['step_s'] / limit['step_s']:.2f}x"
            + (" (goal <= 1.5x)" if arm == "sao async" else ""),
            flush=True,
        )


if __name__ == "__main__":
    if "--probe" in sys.argv:
        import argparse

        parser = argparse.ArgumentParser()
        parser.add_argument("--probe")
        parser.add_argument("--steps", type=int)
        parser.add_argument("--home", type=Path)
        args = parser.parse_args()
        print(json.dumps(probe(args.probe, args.steps, args.home)))
    else:
        run()
