"""Pure SAO math on tensors (imports torch only). docs/design.md section 2 is the specification."""

from components.algo.baselines import (
    RunningMeanBaseline,
    broadcast_sequence_advantages,
    grpo_advantages,
    normalize_advantages,
)
from components.algo.gae import (
    discounted_reverse_cumsum,
    gae,
    gae_by_row,
    gae_reference,
    length_adaptive_lambda,
    timestep_mask,
)
from components.algo.losses import (
    DIS_PRESETS,
    anchor_kl,
    clipped_value_loss,
    dis_policy_loss,
    dis_window_mask,
    entropy_from_logits,
    ppo_policy_loss,
)
from components.algo.reductions import (
    explained_variance,
    masked_mean,
    masked_sum,
    masked_var,
)

__all__ = [
    "DIS_PRESETS",
    "anchor_kl",
    "RunningMeanBaseline",
    "broadcast_sequence_advantages",
    "clipped_value_loss",
    "discounted_reverse_cumsum",
    "dis_policy_loss",
    "dis_window_mask",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "gae_by_row",
    "gae_reference",
    "grpo_advantages",
    "length_adaptive_lambda",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "normalize_advantages",
    "ppo_policy_loss",
    "timestep_mask",
]
