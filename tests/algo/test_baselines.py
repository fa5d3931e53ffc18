"""GRPO advantages, running-mean baseline, normalisation, reductions: hand-computed numbers."""

import math

import pytest
import torch

from components.algo import (
    RunningMeanBaseline,
    broadcast_sequence_advantages,
    explained_variance,
    grpo_advantages,
    masked_mean,
    normalize_advantages,
)


def test_grpo_group_normalised():
    # Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735 -> +-0.866025
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    torch.testing.assert_close(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / math.sqrt(1 / 3), atol=1e-5, rtol=0)
    assert torch.equal(adv[1], torch.zeros(4))  # equal rewards: no signal, and no NaN
    centred = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), scale_by_std=False)
    assert torch.equal(centred, torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.ones(3, 1))


def test_running_mean_baseline_lags_by_its_window():
    baseline = RunningMeanBaseline(window=2)
    assert baseline.advantages(torch.tensor([1.0])).item() == 1.0  # baseline 0 before any reward
    assert baseline.advantages(torch.tensor([0.0])).item() == -1.0  # baseline 1
    assert baseline.advantages(torch.tensor([0.0])).item() == -0.5  # window [1, 0] -> 0.5
    assert baseline.value == 0.0  # window [0, 0]: the 1 fell out
    restored = RunningMeanBaseline()
    restored.load_state_dict(baseline.state_dict())
    assert restored.window == 2 and restored.value == 0.0


def test_normalize_and_reductions():
    adv = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert masked_mean(adv, mask).item() == 2.0
    # mean 2, population std 1 over the two kept tokens -> [-1, 1], masked token 0
    torch.testing.assert_close(normalize_advantages(adv, mask), torch.tensor([[-1.0, 1.0, 0.0]]))
    assert masked_mean(adv, torch.zeros_like(mask)).item() == 0.0  # empty mask: 0, not NaN
    per_token = broadcast_sequence_advantages(torch.tensor([2.0, -1.0]), torch.tensor([[0, 1, 1], [1, 0, 0]]))
    assert torch.equal(per_token, torch.tensor([[0.0, 2.0, 2.0], [-1.0, 0.0, 0.0]]))


def test_explained_variance():
    # residual [0, 0, 0, 1]: var 0.1875; var(returns [1, 2, 3, 4]) = 1.25 -> 1 - 0.15 = 0.85
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 50.0]])
    values = torch.tensor([[1.0, 2.0, 3.0, 3.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(0.85)
    assert explained_variance(values, returns, mask * 0).item() == 0.0


def test_explained_variance_of_constant_returns_is_zero_not_huge():
    returns = torch.full((1, 4), 0.8125) + torch.tensor([[0.0, 1e-7, 0.0, -1e-7]])  # rounding-level variance
    assert explained_variance(torch.zeros(1, 4), returns, torch.ones(1, 4)).item() == 0.0
