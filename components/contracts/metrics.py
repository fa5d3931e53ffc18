"""Metric names: part of the interface (docs/design.md section 6). Trackers, the Prometheus exporter, the
dashboards and the tests take the names from here."""

ALGORITHM_METRICS = (
    "policy/loss",
    "policy/entropy",
    "policy/grad_norm",
    "dis/ratio_mean",
    "dis/masked_frac_low",
    "dis/masked_frac_high",
    "dis/approx_kl",
    "critic/loss",
    "critic/explained_variance",
    "critic/grad_norm",
    "critic/value_mean",
    "adv/mean",
    "adv/std",
)
"""What an algorithm step reports (components/training/rl/algorithms.py): the policy update, DIS, the critic, the
advantages."""

LOOP_METRICS = (
    "reward/mean",
    "rollout/staleness_mean",
    "rollout/staleness_max",
    "rollout/tokens_per_s",
    "rollout/trajectories_per_s",
    "rollout/turns_mean",
    "rollout/length_mean",
    "trainer/idle_frac",
    "trainer/step_s",
)
"""What the loop adds to every step's row (components/training/rl/trainer.py)."""

DESIGN_METRICS = ALGORITHM_METRICS + LOOP_METRICS
"""docs/design.md section 6's names (with `eval/<benchmark>/accuracy`, logged by evaluation)."""

DIAGNOSTIC_METRICS = (
    "policy/entropy_argmax",
    "policy/entropy_other",
    "policy/nonargmax_frac",
    "adv/failed_mean",
    "adv/success_mean",
    "adv/traj_extreme",
)
"""Added to the algorithm's for collapse diagnosis (components/training/rl/diagnostics.py, docs/stability.md)."""
