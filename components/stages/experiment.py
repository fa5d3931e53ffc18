"""`sao experiment NAME`: one of the paper's claims measured as arms x seeds from one shared SFT policy.

An experiment is a list of arms (config overrides on the preset), a number of seeds per arm and overrides every
arm shares (the forced lag of `stability`, the preference schedule of `style-shift`). Each arm is a `sao sweep`
(components/stages/sweep.py) of its own config, kept where that sweep keeps it, `home/sweeps/sweep-<hash of the
config>/`: an arm whose config another experiment (or a plain `sao sweep`) already ran is read back, not re-run,
and a re-run of the command continues where it stopped (finished seeds are read back, an interrupted one resumes
from its newest checkpoint).

    home/experiments/<label>/results.{md,csv,json}  the table: per arm, runs, held-out accuracy (mean, min-max, 95%
                                                    t-interval; against the reference arm, Welch's interval),
                                                    collapses and their steps, rollbacks
    home/experiments/<label>/curves.png             reward per step per arm (mean, min-max band) and each seed's
                                                    held-out accuracy

The statistics are computed in components/eval/experiment_stats.py, the table and plot written by
components/eval/experiment_report.py. The label is the name, then the preset unless `tiny-cpu`, the setting unless
`default`, `quick`, and a hash of `--set` overrides when there are any.

MLflow: a parent run `experiment/<name>` with each arm's sweep run nested under it (and each seed's run under
that), the table and plot as its artifacts. Settings: `default` is the preset's task; `hard` widens it (two-call
problems, a wider mental-math habit), so that arms that all reach the default task's ceiling can differ.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from components.config import STYLES, Config, load_config
from components.eval.experiment_report import write_report
from components.eval.experiment_stats import ArmResult
from components.eval.online import reward_curve
from components.stages.home import Log
from components.stages.recipes import fingerprint
from components.stages.style_shift import schedule
from components.stages.sweep import run_sweep, sweep_name
from components.tracking.stage_runs import tagged_run

EXPERIMENT_TAG = "sao.experiment"


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Experiment:
    claims: str
    """Which of the paper's claims (docs/results.md) the experiment measures."""
    arms: tuple[Arm, ...]
    seeds: int
    """Seeds per arm at the default scale."""
    overrides: tuple[str, ...] = ()
    """Overrides every arm shares, before its own."""
    steps_per_phase: int = 0
    """Preference phases of this many steps (style-shift): the table adds reward per phase and steps to recover."""
    reference: str = "sao"
    """The arm every other arm is compared with: the difference of mean held-out accuracy, its Welch 95% interval
    and p-value."""


STEPS_PER_PHASE = 60
STYLE_KL_ANCHOR = 0.1
"""`algo.kl_anchor` of style-shift's anchored arms."""

FORCED_LAG = (
    # Updates run ahead of their rollouts: 64 episodes in flight for batches of 16 (the preset: 16), up to 8 versions
    # old (the preset: 2), tool calls with a heavy-tailed latency; the guard only logs, and the learning rate stays
    # at its peak after warm-up, so that a collapse has room to show.
    "rollout.concurrency=64",
    "train.max_staleness=8",
    'rollout.latency="lognormal"',
    "rollout.latency_mean_s=0.3",
    "rollout.latency_sigma=1.5",
    'train.collapse_guard="off"',
    "train.min_lr_ratio=1.0",
    "train.max_steps=300",
)

SAFEGUARD_PARTS = {
    # What the public SAO ports added to stay stable (docs/results.md): Lego-RL's 20 critic-only warm-up steps on top of
    # the pretrained critic, its critic gradient clip of 10 and advantage whitening; unirl's eviction of trajectories
    # whose oldest token is too many versions behind (half the forced lag's bound); EasyDeL's (VAPO's) length-adaptive
    # lambda for the policy. Not tuned here.
    "warmup": "train.critic_warmup_steps=20",
    "clip10": "train.critic_grad_clip=10.0",
    "whiten": "algo.normalize_advantages=true",
    "evict": "train.max_token_lag=4",
    "lam": "algo.lam_length_alpha=0.05",
}
SAFEGUARDS = tuple(SAFEGUARD_PARTS.values())
"""The safeguards as one bundle, as the ports run them."""
R3 = ('algo.routing_replay="r3"',)

EXPERIMENTS: dict[str, Experiment] = {
    "stability": Experiment(
        "(a) GRPO collapses under policy lag, (b) DIS removes the collapse, (c) SAO pulls ahead of GRPO+DIS",
        (
            # GRPO's arms drop groups without signal (all rewards equal) so that each step updates the policy, as
            # SAO's does: unfiltered, only 37-63 of 300 steps did (docs/results.md), which measured how often GRPO
            # moved rather than how it survives lag.
            Arm("grpo", ('train.algo="grpo"', 'train.group_filter="drop-uniform"')),
            Arm("grpo-dis", ('train.algo="grpo-dis"', 'train.group_filter="drop-uniform"')),
            Arm("sao"),
            # Routing replay, the safeguards, and both: what the paper's conditions (a bf16 engine, `--setting paper`)
            # call for; under the default setting's fp32 engine R3 replays routing drift from lag alone.
            Arm("sao-r3", R3),
            Arm("sao-safeguards", SAFEGUARDS),
            Arm("sao-r3-safeguards", (*R3, *SAFEGUARDS)),
            # Each safeguard alone, on R3: which part of the bundle does what it did (docs/results.md).
            *(Arm(f"sao-r3-{part}", (*R3, override)) for part, override in SAFEGUARD_PARTS.items()),
            # The control: the same run without the forced lag (the preset's in-flight count, staleness bound and
            # tools), so that a collapse of the lagged arms can be told from one the constant learning rate causes.
            Arm("sao-preset-lag", ("rollout.concurrency=16", "train.max_staleness=2", 'rollout.latency="none"')),
        ),
        seeds=3,
        overrides=FORCED_LAG,
    ),
    "ablation": Experiment(
        "(c) SAO against GRPO+DIS at the preset's lag, (d) K=2 over K=1, (e) frozen attention over a full-parameter "
        "critic, (f) a critic over a running mean; PPO's clip in place of DIS, GAE through observation tokens, "
        "routing replay, and the guard's near-peak rollback",
        (
            Arm("sao"),
            Arm("sao-k1", ('train.algo="sao-k1"',)),
            Arm("sao-full-critic", ('train.algo="sao-full-critic"',)),
            Arm("sao-running-mean", ('train.algo="sao-running-mean"',)),
            Arm("ppo", ('train.algo="ppo"',)),
            Arm("sao-no-skip-obs", ("algo.skip_observations=false",)),
            Arm("grpo-dis", ('train.algo="grpo-dis"', 'train.group_filter="drop-uniform"')),
            # Routing replay on the preset's schedule: under `--setting paper`'s bf16 engine it removes the routing
            # flips between sampler and trainer; under the default fp32 engine it replays the drift of lag alone.
            Arm("sao-r3", R3),
            # The guard returning to before the reward's decline from near its peak, not to before the collapse's
            # onset: a paper-setting run drifted from 0.62 to 0.26 and the onset's checkpoint was already at 0.33.
            Arm("sao-near-peak", ('train.rollback_to="near-peak"',)),
        ),
        seeds=5,
    ),
    "value-pretraining": Experiment(
        "(g) value-model pretraining overcomes the critic's cold start",
        (Arm("cold", ("value_pretrain.warm_start=false",)), Arm("warm")),
        seeds=5,
        reference="warm",
    ),
    "style-shift": Experiment(
        "(f) after a reward preference flips, the critic re-aligns while the running mean lags",
        (
            Arm("sao"),
            Arm("sao-running-mean", ('train.algo="sao-running-mean"',)),
            # Exploration kept: a KL anchor to the SFT policy, which writes all three styles (one weight, not tuned).
            Arm("sao-kl-anchor", (f"algo.kl_anchor={STYLE_KL_ANCHOR}",)),
            Arm("sao-running-mean-kl-anchor", ('train.algo="sao-running-mean"', f"algo.kl_anchor={STYLE_KL_ANCHOR}")),
        ),
        seeds=3,
        overrides=(
            'env.name="style"',
            # Partial credit as an LLM judge gives it (components/envs/style.py): a policy that mixes in the new
            # style is rewarded for it, so a flip leaves something to learn from.
            'env.judge="graded"',
            f'env.preference_schedule="{schedule(STEPS_PER_PHASE)}"',
            f"train.max_steps={STEPS_PER_PHASE * len(STYLES)}",
            # A flip drops the reward by design; the guard would take it for a collapse and roll back across it.
            'train.collapse_guard="off"',
        ),
        steps_per_phase=STEPS_PER_PHASE,
    ),
}


@dataclass(frozen=True)
class Setting:
    overrides: tuple[str, ...] = ()
    """Applied before the experiment's own (an experiment keeps what defines it, e.g. stability's forced lag)."""
    max_steps: int | None = None
    """RL steps of every arm, after the experiment's overrides (an experiment with preference phases keeps its own
    length: the phases define it); None: the experiment's or the preset's."""

    def steps_for(self, experiment: Experiment) -> list[str]:
        """The override of `max_steps` where it applies to `experiment` (none where its phases define its length)."""
        return [f"train.max_steps={self.max_steps}"] if self.max_steps and not experiment.steps_per_phase else []


HARD = ('task.kinds=["affine", "two_step"]', "task.teacher_mental_max=2000")

SETTINGS: dict[str, Setting] = {
    "default": Setting(),
    # Half the problems need two tool calls ((a*b+c)*d), and the teacher answers mentally up to a*b < 2000 (the
    # default: 700), a zone the tiny student can only solve by learning to call the tool there.
    "hard": Setting(HARD),
    # The conditions SAO exists for (issue 45, docs/results.md): the hard task, the engine sampling in bf16 for the fp32
    # trainer (sampler-trainer mismatch, MoE routing flips between the two), tool calls with a heavy-tailed latency
    # and staleness by design (64 episodes in flight for batches of 16, up to 8 versions old), 400 steps.
    "paper": Setting(
        (
            *HARD,
            'rollout.engine_dtype="bfloat16"',
            'rollout.latency="lognormal"',
            "rollout.latency_mean_s=0.3",
            "rollout.latency_sigma=1.5",
            "rollout.concurrency=64",
            "train.max_staleness=8",
        ),
        max_steps=400,
    ),
}

QUICK = (
    # CI-sized: a few updates of small batches, a small held-out set, a short value pretraining. SFT is the preset's
    # (its recipe is untouched, so a home that has the SFT policy reuses it).
    "train.max_steps=3",
    "train.batch_size=4",
    "train.group_size=2",
    "rollout.concurrency=4",
    "task.eval_size=8",
    'train.backend="torch"',
    "value_pretrain.episodes=16",
    "value_pretrain.max_epochs=1",
)
QUICK_SEEDS = 2
QUICK_STEPS_PER_PHASE = 1


def arm_configs(
    name: str, preset: str, overrides: list[str], setting: str = "default", quick: bool = False
) -> list[tuple[Arm, Config]]:
    """Each arm of experiment `name` with its config: the preset, then the setting's overrides, the experiment's
    shared ones, the quick ones, the user's `overrides` and the arm's own (a later override wins: the user can change
    what the experiment sets, the arm keeps what defines it). A bad name or setting is refused naming the known ones."""
    experiment = experiment_named(name)
    if setting not in SETTINGS:
        raise ValueError(f"--setting: unknown setting {setting!r}; known: {sorted(SETTINGS)}")
    chosen = SETTINGS[setting]
    shared = [*chosen.overrides, *experiment.overrides, *chosen.steps_for(experiment)]
    if quick:
        shared += [*QUICK, *_quick_phases(experiment)]
    return [(arm, load_config(preset, [*shared, *overrides, *arm.overrides])) for arm in experiment.arms]


def experiment_named(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise ValueError(f"NAME: unknown experiment {name!r}; known: {sorted(EXPERIMENTS)}")
    return EXPERIMENTS[name]


def experiment_label(
    name: str,
    overrides: list[str],
    setting: str = "default",
    quick: bool = False,
    preset: str = "tiny-cpu",
    arms: list[str] | None = None,
) -> str:
    """Where an experiment's table lives and how MLflow finds its parent again: the name, the preset unless
    `tiny-cpu`, the setting unless `default`, `quick`, a hash of the user's overrides when there are any (so that
    `--set` studies of one experiment keep their own tables), and the arms when only some run (a partial table
    never replaces the whole one)."""
    parts = [name, "" if preset == "tiny-cpu" else preset, "" if setting == "default" else setting]
    parts.append("quick" if quick else "")
    parts.append(fingerprint({"overrides": list(overrides)})[:8] if overrides else "")
    parts.append("+".join(sorted(arms)) if arms else "")
    return "-".join(p for p in parts if p)


def _quick_phases(experiment: Experiment) -> list[str]:
    if not experiment.steps_per_phase:
        return []
    return [
        f'env.preference_schedule="{schedule(QUICK_STEPS_PER_PHASE)}"',
        f"train.max_steps={QUICK_STEPS_PER_PHASE * len(STYLES)}",
    ]


def run_experiment(
    name: str,
    preset: str,
    overrides: list[str],
    home: Path,
    setting: str = "default",
    quick: bool = False,
    seeds: int | None = None,
    arms: list[str] | None = None,
    log: Log = print,
) -> dict:
    """Every arm's seeds, one arm after another (each run takes both cores), then the table and the plot. Returns
    `{"table": [rows], "report": path of results.md, "phases": [rows] (style-shift only)}`."""
    experiment = experiment_named(name)
    configs = arm_configs(name, preset, overrides, setting, quick)
    if arms:
        unknown = sorted(set(arms) - {arm.name for arm, _ in configs})
        if unknown:
            raise ValueError(f"--arms: unknown arm(s) {unknown} of {name}; known: {[a.name for a, _ in configs]}")
        configs = [(arm, cfg) for arm, cfg in configs if arm.name in arms]
    seeds = seeds or (QUICK_SEEDS if quick else experiment.seeds)
    label = experiment_label(name, overrides, setting, quick, preset, arms)
    out = home / "experiments" / label
    parent = tagged_run(configs[0][1], home, EXPERIMENT_TAG, label, f"experiment/{label}")
    log(f"experiment {label}: {experiment.claims}; {len(configs)} arm(s) x {seeds} seed(s); table at {out}/results.md")
    results: list[ArmResult] = []
    try:
        for arm, cfg in configs:
            log(f"experiment {label}: arm {arm.name} ({', '.join(arm.overrides) or 'the preset'})")
            runs = run_sweep(cfg, home, seeds, first_seed=1, log=log, parent_run_id=parent.run_id)
            sweep = sweep_name(cfg)
            results.append(ArmResult(arm.name, runs, [_reward_curve(home, sweep, cfg, r.seed) for r in runs], sweep))
    except BaseException:
        parent.close(failed=True)  # a re-run finds it again by its tag and continues under it
        raise
    env = configs[0][1].env
    phases = list(env.preference_phases) if env.preference_schedule else []
    report = write_report(out, label, _about(experiment, setting), experiment.reference, results, phases)
    parent.log_metrics(
        {f"experiment/{r.arm}/accuracy_mean": statistics.fmean(s.accuracy for s in r.runs) for r in results}
        | {f"experiment/{r.arm}/collapsed": float(sum(s.collapsed for s in r.runs)) for r in results}
    )
    for filename in ("results.md", "results.csv", "results.json", "curves.png"):
        parent.log_artifact(out / filename)
    parent.close()
    log(f"experiment {label}: done; {out}/results.md")
    return report


def _reward_curve(home: Path, sweep: str, cfg: Config, seed: int) -> list[float]:
    return reward_curve(home / "sweeps" / sweep / f"seed-{seed}" / "runs" / cfg.name / f"{cfg.train.algo}.jsonl")


def _about(experiment: Experiment, setting: str) -> str:
    """The report's paragraph under its title: the claims measured and the setting's overrides."""
    return f"Claims: {experiment.claims}. Setting: {setting} ({', '.join(_setting_overrides(experiment, setting)) or 'the preset task'})."


def _setting_overrides(experiment: Experiment, setting: str) -> list[str]:
    chosen = SETTINGS[setting]
    return [*chosen.overrides, *chosen.steps_for(experiment)]
