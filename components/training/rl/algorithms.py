"""SAO and the paper's baselines as data: each algorithm is how its advantages are estimated, which policy loss it
trains with and what its critic is. The one step that runs them all is `step.py`.

    algorithm          advantages                                   loss   critic
    sao                skip-observation GAE, critic updated K times  DIS    attention frozen (the paper's)
    sao-k1             the same with K = 1                           DIS    attention frozen
    sao-full-critic    the same, every critic weight trained         DIS    full-parameter
    sao-running-mean   outcome reward - mean of the last rewards     DIS    none
    grpo               group-normalised outcome reward (barrier)     PPO    none
    grpo-dis           the same                                      DIS    none
    ppo                skip-observation GAE, K = 1                   PPO    full-parameter

`AlgoSettings` is what a step needs of the config, resolved once (`settings_from`): the math never sees a config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from components.config import AlgoName, Config

Advantage = Literal["gae", "running-mean", "grpo"]
Loss = Literal["dis", "ppo"]


@dataclass(frozen=True)
class Algorithm:
    advantage: Advantage
    """How the policy's advantages are estimated: skip-observation GAE from a critic updated first (`gae`), the outcome
    reward less a running mean of rewards (`running-mean`), or GRPO's group-normalised outcome reward (`grpo`)."""
    loss: Loss
    """The policy loss against the rollout log-probs: DIS's double-sided mask (`dis`) or PPO's clip (`ppo`)."""
    freeze_critic_attention: bool = False
    """The critic's attention frozen (SAO's critic), else every critic weight trains."""
    critic_updates: int | None = None
    """Overrides the configured K (`algo.critic_updates`); None keeps it."""

    @property
    def uses_critic(self) -> bool:
        """Builds and trains a value model."""
        return self.advantage == "gae"

    @property
    def grouped(self) -> bool:
        """One prompt is sampled `train.group_size` times and trained as a group (GRPO's barrier)."""
        return self.advantage == "grpo"


ALGORITHMS: dict[AlgoName, Algorithm] = {
    "sao": Algorithm(advantage="gae", loss="dis", freeze_critic_attention=True),
    "sao-k1": Algorithm(advantage="gae", loss="dis", freeze_critic_attention=True, critic_updates=1),
    "sao-full-critic": Algorithm(advantage="gae", loss="dis"),
    "sao-running-mean": Algorithm(advantage="running-mean", loss="dis"),
    "grpo": Algorithm(advantage="grpo", loss="ppo"),
    "grpo-dis": Algorithm(advantage="grpo", loss="dis"),
    "ppo": Algorithm(advantage="gae", loss="ppo", critic_updates=1),
}


@dataclass(frozen=True)
class AlgoSettings:
    """The numbers a step needs (resolved from the config once; math functions never see config objects)."""

    gamma: float
    lam_critic: float
    lam_policy: float
    eps_low: float
    eps_high: float
    temperature: float
    critic_updates: int
    value_clip: float
    normalize_advantages: bool
    ppo_clip: float = 0.2
    group_size: int = 1
    micro_batch_tokens: int = 0
    """Padded tokens per forward/backward pass on each rank (0: a rank's rows in one pass; engines/micro.py)."""
    skip_observations: bool = True
    """Skip-observation GAE (False: the ablation that steps through observation tokens; algo/gae.py)."""
    whiten_below_ev: float | None = None
    """Whiten the policy's advantages while the updated critic's explained variance is below this (None: never)."""
    lam_length_alpha: float = 0.0
    """VAPO's length-adaptive lambda for the policy (`algo.gae.length_adaptive_lambda`); 0: `lam_policy`."""
    kl_anchor: float = 0.0
    """Weight of the KL anchor to the SFT policy (`algo.kl_anchor`; the batch then holds `reference_logprobs`)."""
    advantage: Advantage = "gae"
    """The algorithm's advantage estimator (`Algorithm.advantage`)."""
    loss: Loss = "dis"
    """The algorithm's policy loss (`Algorithm.loss`)."""


def settings_from(cfg: Config) -> AlgoSettings:
    """The numbers a step needs, resolved from a config once (the steps never see config objects)."""
    algorithm = ALGORITHMS[cfg.train.algo]
    eps_low, eps_high = cfg.algo.dis_window
    return AlgoSettings(
        gamma=cfg.algo.gamma,
        lam_critic=cfg.algo.lam_critic,
        lam_policy=cfg.algo.lam_policy,
        eps_low=eps_low,
        eps_high=eps_high,
        temperature=cfg.algo.temperature,
        critic_updates=algorithm.critic_updates or cfg.algo.critic_updates,
        value_clip=cfg.algo.value_clip,
        normalize_advantages=cfg.algo.normalize_advantages,
        group_size=cfg.train.group_size if algorithm.grouped else 1,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
        skip_observations=cfg.algo.skip_observations,
        whiten_below_ev=cfg.algo.whiten_below_ev,
        lam_length_alpha=cfg.algo.lam_length_alpha,
        kl_anchor=cfg.algo.kl_anchor,
        advantage=algorithm.advantage,
        loss=algorithm.loss,
    )
