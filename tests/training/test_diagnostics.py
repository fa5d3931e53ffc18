"""Collapse diagnostics (components/training/rl/diagnostics.py) on a hand-made batch."""

import pytest
import torch

from components.models.logprobs import TokenStats
from components.training.engines.collective import SOLO
from components.training.rl.diagnostics import policy_diagnostics


def test_policy_diagnostics_by_hand():
    act = torch.tensor([[0, 1, 1, 0, 1], [0, 1, 1, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor([[0, 0, 0, 0, 1.0], [0, 0, 0, 0.0, 0]])  # row 0 succeeded, row 1 failed
    # 9s sit off the action tokens: they must not count anywhere.
    entropy = torch.tensor([[9, 0.1, 0.2, 9, 0.3], [9, 0.4, 0.5, 0.6, 9]])
    is_argmax = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([[9, 1.0, 2.0, 9, 3.0], [9, -1.0, -2.0, -4.0, 9]])
    m = policy_diagnostics(TokenStats(entropy, is_argmax), advantages, {"action_mask": act, "rewards": rewards}, SOLO)
    # Argmax action tokens: 0.1, 0.3 (row 0) and 0.4, 0.5 (row 1) -> 1.3 / 4; the rest: 0.2 and 0.6 -> 0.4.
    assert m["policy/entropy_argmax"].item() == pytest.approx(0.325)
    assert m["policy/entropy_other"].item() == pytest.approx(0.4)
    assert m["policy/nonargmax_frac"].item() == pytest.approx(2 / 6)
    # Success (row 0): (1 + 2 + 3) / 3 = 2; failure (row 1): (-1 - 2 - 4) / 3 = -7/3, the larger magnitude.
    assert m["adv/success_mean"].item() == pytest.approx(2.0)
    assert m["adv/failed_mean"].item() == pytest.approx(-7 / 3)
    assert m["adv/traj_extreme"].item() == pytest.approx(-7 / 3)


def test_empty_subsets_report_zero():
    act = torch.tensor([[0, 1, 1]], dtype=torch.float32)
    stats = TokenStats(torch.tensor([[0, 0.5, 0.5]]), torch.tensor([[0, 1, 1]], dtype=torch.bool))
    m = policy_diagnostics(stats, torch.zeros(1, 3), {"action_mask": act, "rewards": torch.zeros(1, 3)}, SOLO)
    assert m["policy/entropy_other"].item() == 0.0 and m["adv/success_mean"].item() == 0.0
    assert m["policy/nonargmax_frac"].item() == 0.0 and m["policy/entropy_argmax"].item() == pytest.approx(0.5)
