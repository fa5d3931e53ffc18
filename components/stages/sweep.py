"""`sao sweep`: one config trained with N RL seeds from one shared SFT policy, and a table of how each ended.

    home/models/sft-<env>/                  the shared SFT policy (trained once, as `sao train` does)
    home/models/critic-<env>-<key>/         the shared pretrained critic, when `value_pretrain.warm_start` (as the
                                            pipeline starts RL; a set `train.critic_path` is used as it is)
    home/sweeps/<name>/config.json          the swept config (a re-run with another config is refused)
    home/sweeps/<name>/seed-<k>/            each seed's own run home: checkpoints, metrics, policy, report
    home/sweeps/<name>/seed-<k>/result.json that seed's row, written last (a finished seed is not re-run)
    home/sweeps/<name>/results.{md,csv}     the table

Seeds run one after another: each run already takes both cores of this machine (engine and trainer threads),
so running two at once would only slow both. Re-running the same command continues where it stopped:
finished seeds are read back, an interrupted one resumes from its newest checkpoint.

MLflow: a parent run `sweep/<name>` with one nested run per seed, and the table as the parent's artifact.
A collapse is what `components/training/rl/stability.py` says it is, online (replayed from the logged reward
curve, exactly as the trainer's guard saw it) or on the held-out set after training.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from components.config import Config, to_dict
from components.envs.registry import build_env
from components.eval.tables import markdown_table
from components.stages.evaluate import run_eval
from components.stages.home import Log
from components.stages.recipes import fingerprint
from components.stages.sft import run_sft, sft_eval
from components.stages.value_pretrain import critic_origin, starting_critic, with_critic
from components.storage import HomeStateError, write_json
from components.tracking import DiskTracker, open_tracker
from components.tracking.stage_runs import StageRun, tagged_run
from components.training.rl.stability import CollapseDetector, collapsed_on_eval
from components.training.rl.trainer import train

SWEEP_TAG = "sao.sweep"


@dataclass
class SeedResult:
    seed: int
    accuracy: float
    """Held-out greedy accuracy after training."""
    delta: float
    """accuracy - the SFT policy's, in points."""
    collapsed: bool
    collapse_step: int | None
    """Step at which the online rule first fired (None if it never did)."""
    cause: str
    """`reward` (online rule), `eval` (held-out below SFT), both, or empty."""
    rollbacks: int
    peak_entropy: float
    max_masked_frac: float
    """Largest dis/masked_frac_low + dis/masked_frac_high of any step."""
    final_ev: float
    """critic/explained_variance, mean of the last 10 steps (NaN without a critic)."""
    final_reward: float
    """reward/mean, mean of the last 10 steps."""
    minutes: float
    max_kl: float = float("nan")
    """Largest dis/approx_kl of any step: a spike (0.05 and more) is one update that moved the policy far from
    the one that sampled the next batches (docs/stability.md). NaN in result files written before it existed."""
    policy_updates: int = -1
    """Steps whose advantages carried signal (`adv/std` > 0), the steps that moved the policy: GRPO's groups whose
    rewards are all equal give none. -1 in result files written before it existed."""
    early_reward: float = float("nan")
    """reward/mean over the first `EARLY_STEPS` steps: the batches training got before the policy moved far (eviction
    of slow trajectories lowers it: the slow ones are the long two-call episodes)."""
    evicted: int = -1
    """Trajectories evicted for their oldest token's lag (`rollout/evicted`, 0 with eviction off)."""
    staleness_mean: float = float("nan")
    """rollout/staleness_mean over the run's steps."""
    staleness_max: int = -1
    """The largest rollout/staleness_max of any step."""
    mismatch_kl: float = float("nan")
    """Median of rollout/mismatch_kl over the steps that logged it (those with tokens sampled at the version being
    trained): the sampler-trainer mismatch. NaN when no step logged it."""


EARLY_STEPS = 50
MEASURED_LATER = ("early_reward", "evicted", "staleness_mean", "staleness_max", "mismatch_kl")
"""Fields a result file written before they existed lacks; read back, they are computed from the run's metrics."""


ADDED_LATER = {"train": {"rollback_to": "onset"}}
"""Fields added after sweeps were on disk, each with its default: a config at the default leaves the field out of
what a sweep stores and hashes, so those sweeps' directories (and their runs) still match their configs."""


def swept_config(cfg: Config) -> dict:
    """What a sweep runs: the config without its RL seed (and without `ADDED_LATER`'s fields at their defaults),
    as JSON data."""
    swept = json.loads(json.dumps({**to_dict(cfg), "train": {**to_dict(cfg.train), "task_seed": None}}))
    for section, fields in ADDED_LATER.items():
        for field, default in fields.items():
            if swept[section][field] == default:
                del swept[section][field]
    return swept


def sweep_name(cfg: Config) -> str:
    """The directory under home/sweeps of a sweep run without `--name`: the hash of its config."""
    return f"sweep-{fingerprint(swept_config(cfg))}"


def run_sweep(
    cfg: Config,
    home: Path,
    seeds: int,
    first_seed: int = 1,
    name: str | None = None,
    log: Log = print,
    parent_run_id: str | None = None,
) -> list[SeedResult]:
    """`seeds` RL runs of `cfg` (train.task_seed from `first_seed`), their table, and MLflow runs nested under a
    parent `sweep/<name>` (itself nested under `parent_run_id` when given: an experiment's arm)."""
    if seeds < 1:
        raise ValueError(f"--seeds: must be >= 1, got {seeds}")
    swept = swept_config(cfg)
    name = name or sweep_name(cfg)
    root = home / "sweeps" / name
    stored = root / "config.json"
    if stored.exists() and json.loads(stored.read_text()) != swept:
        raise HomeStateError(f"{root} holds a sweep of another config; pick another --name or remove it")
    write_json(stored, swept)
    sft_dir = run_sft(cfg, home, log=log)
    sft_accuracy = sft_eval(cfg, sft_dir, home, log)
    critic = starting_critic(cfg, home, sft_dir, log)
    log(
        f"sweep {name}: {seeds} seed(s) from {first_seed}, each from the policy {sft_dir} (SFT held-out accuracy "
        f"{sft_accuracy:.1%}) and {critic_origin(cfg, critic)}; table at {root}/results.md"
    )
    cfg = with_critic(cfg, critic)
    parent = tagged_run(cfg, home, SWEEP_TAG, name, f"sweep/{name}", parent_run_id)
    results = []
    try:
        for seed in range(first_seed, first_seed + seeds):
            # Each seed keeps its checkpoints in its own home: seeds of one config would share one store prefix.
            seeded = replace(
                cfg, train=replace(cfg.train, task_seed=seed), store=replace(cfg.store, uri=str(root / f"seed-{seed}"))
            )
            results.append(_run_seed(seeded, home, root, sft_dir, sft_accuracy, parent, log))
            _write_table(root, results, sft_accuracy)
    except BaseException:
        parent.close(failed=True)  # a re-run finds it again by its tag and continues under it
        raise
    _finish_parent(parent, root, results)
    log(summary_line(results, sft_accuracy))
    return results


def _run_seed(
    cfg: Config, home: Path, root: Path, sft_dir: Path, sft_accuracy: float, parent: StageRun, log: Log
) -> SeedResult:
    seed, seed_home = cfg.train.task_seed, root / f"seed-{cfg.train.task_seed}"
    done = seed_home / "result.json"
    metrics = seed_home / "runs" / cfg.name / f"{cfg.train.algo}.jsonl"
    if done.exists():
        log(f"sweep: seed {seed} finished earlier")
        return _read_back(done, metrics, sft_accuracy)
    tracker = open_tracker(cfg.tracking, home, f"{root.name}/seed-{seed}", metrics, parent_run_id=parent.run_id)
    start, failed = time.perf_counter(), True
    try:
        result = train(
            cfg,
            build_env(cfg, log),
            sft_dir,
            seed_home,
            tracker,
            resume=True,
            log=_every_tenth_step(log, f"[seed {seed}] "),
        )
        accuracy = run_eval(cfg, result.policy_dir, seed_home, f"{cfg.train.algo}-eval", log=log).accuracy
        tracker.log_metrics({f"eval/{cfg.env.name}/accuracy": accuracy}, result.version)
        failed = False
    finally:
        tracker.close(failed)
    row = summarize(seed, _history(metrics), accuracy, sft_accuracy, (time.perf_counter() - start) / 60)
    write_json(done, asdict(row))
    collapse = f"{row.cause}, step {row.collapse_step}" if row.collapse_step else row.cause
    log(
        f"sweep: seed {seed}: {accuracy:.1%} ({row.delta:+.1f} points)"
        + (f", COLLAPSED ({collapse})" if row.collapsed else "")
    )
    return row


def _read_back(done: Path, metrics: Path, sft_accuracy: float) -> SeedResult:
    """A finished seed's result; the fields its file predates (`MEASURED_LATER`) computed from its metrics when they
    are still there, and written back."""
    stored = json.loads(done.read_text())
    missing = [f for f in MEASURED_LATER if f not in stored]
    if not missing or not metrics.exists():
        return SeedResult(**stored)
    measured = asdict(summarize(stored["seed"], _history(metrics), stored["accuracy"], sft_accuracy, stored["minutes"]))
    row = SeedResult(**{**stored, **{f: measured[f] for f in missing}})
    write_json(done, asdict(row))
    return row


def _history(metrics: Path) -> list[dict]:
    """A run's metric records (`{"step", "metrics"}`), its params record left out."""
    return [r for r in DiskTracker.read(metrics) if "metrics" in r]


def _every_tenth_step(log: Log, prefix: str) -> Log:
    """The trainer's lines, with only every tenth progress line (`step   10/200 ...`)."""

    def filtered(line: str) -> None:
        if not line.startswith("step") or int(line.split()[1].split("/")[0]) % 10 == 0:
            log(prefix + line)

    return filtered


def replay_collapses(history: list[dict]) -> list[int]:
    """Steps at which the online rule fired, replayed over a logged run (`{"step", "metrics"}` records) the way
    the trainer saw it: a rollback record (`trainer/rollback_to`) resets the detector."""
    detector, fired = CollapseDetector(), []
    for record in sorted(history, key=lambda r: r["step"]):
        m = record["metrics"]
        if "trainer/rollback_to" in m:
            detector.reset()
        elif "reward/mean" in m and detector.update(record["step"], m["reward/mean"]) is not None:
            fired.append(record["step"])
    return fired


def summarize(seed: int, history: list[dict], accuracy: float, sft_accuracy: float, minutes: float) -> SeedResult:
    steps = [r["metrics"] for r in sorted(history, key=lambda r: r["step"]) if "reward/mean" in r["metrics"]]
    fired = replay_collapses(history)
    on_eval = collapsed_on_eval(accuracy, sft_accuracy)
    cause = "+".join(c for c, hit in (("reward", bool(fired)), ("eval", on_eval)) if hit)
    last = steps[-10:]
    evs = [m["critic/explained_variance"] for m in last if "critic/explained_variance" in m]
    stale = [m["rollout/staleness_mean"] for m in steps if "rollout/staleness_mean" in m]
    mismatch = [m["rollout/mismatch_kl"] for m in steps if "rollout/mismatch_kl" in m]
    return SeedResult(
        seed=seed,
        accuracy=accuracy,
        delta=100 * (accuracy - sft_accuracy),
        collapsed=bool(cause),
        collapse_step=fired[0] if fired else None,
        cause=cause,
        rollbacks=int(max((r["metrics"].get("trainer/rollbacks", 0) for r in history), default=0)),
        peak_entropy=max((m.get("policy/entropy", 0.0) for m in steps), default=0.0),
        max_masked_frac=max(
            (m.get("dis/masked_frac_low", 0.0) + m.get("dis/masked_frac_high", 0.0) for m in steps), default=0.0
        ),
        final_ev=statistics.fmean(evs) if evs else float("nan"),
        final_reward=statistics.fmean(m["reward/mean"] for m in last) if last else float("nan"),
        minutes=minutes,
        max_kl=max((m.get("dis/approx_kl", 0.0) for m in steps), default=0.0),
        policy_updates=sum(1 for m in steps if m.get("adv/std", 0.0) > 0),
        early_reward=statistics.fmean(m["reward/mean"] for m in steps[:EARLY_STEPS]) if steps else float("nan"),
        evicted=int(max((m.get("rollout/evicted", 0.0) for m in steps), default=0.0)),
        staleness_mean=statistics.fmean(stale) if stale else float("nan"),
        staleness_max=int(max((m.get("rollout/staleness_max", 0.0) for m in steps), default=0.0)),
        mismatch_kl=statistics.median(mismatch) if mismatch else float("nan"),
    )


def summary_line(results: list[SeedResult], sft_accuracy: float) -> str:
    accs = [r.accuracy for r in results]
    return (
        f"sweep: {len(results)} seed(s), SFT {sft_accuracy:.1%}; held-out accuracy mean {statistics.fmean(accs):.1%}"
        f" (SFT {100 * (statistics.fmean(accs) - sft_accuracy):+.1f} points), worst {min(accs):.1%}, best "
        f"{max(accs):.1%}; collapsed {sum(r.collapsed for r in results)}; rollbacks "
        f"{sum(r.rollbacks for r in results)}; {sum(r.minutes for r in results):.0f} min"
    )


def _write_table(root: Path, results: list[SeedResult], sft_accuracy: float) -> None:
    fields = list(SeedResult.__dataclass_fields__)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fields)
    writer.writeheader()
    writer.writerows(asdict(r) for r in results)
    (root / "results.csv").write_text(buffer.getvalue())
    table = markdown_table([_table_row(r) for r in results])
    (root / "results.md").write_text("\n".join([table, "", summary_line(results, sft_accuracy), ""]))


def _table_row(r: SeedResult) -> dict[str, str]:
    """One seed's row of results.md, by column heading."""
    return {
        "seed": str(r.seed),
        "held-out": f"{r.accuracy:.1%}",
        "vs SFT": f"{r.delta:+.1f}",
        "collapse (step, cause)": f"yes ({r.collapse_step or '-'}, {r.cause})" if r.collapsed else "no",
        "rollbacks": str(r.rollbacks),
        "peak entropy": f"{r.peak_entropy:.3f}",
        "max masked": f"{r.max_masked_frac:.3f}",
        "max KL": f"{r.max_kl:.3f}",
        "policy updates": "-" if r.policy_updates < 0 else str(r.policy_updates),
        f"reward, first {EARLY_STEPS} steps": f"{r.early_reward:.3f}",
        "evicted": "-" if r.evicted < 0 else str(r.evicted),
        "staleness mean / max": f"{r.staleness_mean:.1f} / {'-' if r.staleness_max < 0 else r.staleness_max}",
        "mismatch KL (median)": f"{r.mismatch_kl:.1e}",
        "final EV": f"{r.final_ev:.2f}",
        "final reward": f"{r.final_reward:.3f}",
        "min": f"{r.minutes:.1f}",
    }


def _finish_parent(parent: StageRun, root: Path, results: list[SeedResult]) -> None:
    """The table as the parent run's artifacts and its headline numbers as metrics."""
    accs = [r.accuracy for r in results]
    parent.log_metrics(
        {
            "sweep/accuracy_mean": statistics.fmean(accs),
            "sweep/accuracy_min": min(accs),
            "sweep/collapsed": float(sum(r.collapsed for r in results)),
            "sweep/rollbacks": float(sum(r.rollbacks for r in results)),
        }
    )
    for filename in ("results.md", "results.csv"):
        parent.log_artifact(root / filename)
    parent.close()
