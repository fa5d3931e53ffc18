"""DIS, PPO clip and value losses: hand-computed numbers and gradient invariances."""

import math

import pytest
import torch

from components.algo import DIS_PRESETS, anchor_kl, clipped_value_loss, dis_policy_loss, ppo_policy_loss

# Five positions: one non-action token, then four action tokens whose ratios are
# 0.5 (below the reasoning window 0.7), 1 and 2 (inside), 7 (above 6).
ROLLOUT = torch.tensor([[0.0, -1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
LOG_RATIO = torch.tensor([[0.0, math.log(0.5), 0.0, math.log(2.0), math.log(7.0)]], dtype=torch.float64)
ADV = torch.tensor([[5.0, 1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
MASK = torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.float64)


def _dis(eps=DIS_PRESETS["reasoning"]):
    logprobs = (ROLLOUT + LOG_RATIO).requires_grad_(True)
    loss, metrics = dis_policy_loss(logprobs, ROLLOUT, ADV, MASK, *eps)
    loss.backward()
    return loss, metrics, logprobs.grad


def test_dis_below_inside_above_window():
    loss, metrics, grad = _dis()
    # Kept: ratio 1 (A=2) and ratio 2 (A=3). N counts all four action tokens, masked ones included:
    #   loss = -(1 * 2 + 2 * 3) / 4 = -2
    torch.testing.assert_close(loss, torch.tensor(-2.0, dtype=torch.float64))
    # d loss / d logprob_t = -ratio_t * A_t / N inside the window: -1*2/4 = -0.5, -2*3/4 = -1.5; 0 elsewhere.
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -0.5, -1.5, 0.0]], dtype=torch.float64))
    assert metrics["dis/masked_frac_low"].item() == pytest.approx(0.25)
    assert metrics["dis/masked_frac_high"].item() == pytest.approx(0.25)
    assert metrics["dis/ratio_mean"].item() == pytest.approx((0.5 + 1 + 2 + 7) / 4)
    # k3 = r - 1 - log r per token: 0.5 -> 0.193147, 1 -> 0, 2 -> 0.306853, 7 -> 4.054090; mean 1.138523
    assert metrics["dis/approx_kl"].item() == pytest.approx(1.1385225, abs=1e-6)
    assert not any(m.requires_grad for m in metrics.values())


def test_dis_window_is_open_and_coding_preset():
    # Coding preset (0.8, 3.0): window (0.2, 4). Ratios 0.5, 1, 2 kept, 7 masked:
    #   loss = -(0.5 * 1 + 1 * 2 + 2 * 3) / 4 = -2.125
    loss, metrics, grad = _dis(DIS_PRESETS["coding"])
    torch.testing.assert_close(loss, torch.tensor(-2.125, dtype=torch.float64))
    assert grad[0, 4] == 0 and metrics["dis/masked_frac_low"] == 0
    # A ratio exactly on the boundary is masked: window (0.5, 2) with eps = (0.5, 1.0) drops 0.5 and 2.
    loss, _, grad = _dis((0.5, 1.0))
    torch.testing.assert_close(loss, torch.tensor(-2.0 / 4, dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -0.5, 0.0, 0.0]], dtype=torch.float64))


def test_dis_random_tokens_outside_window_get_exactly_zero_gradient():
    torch.manual_seed(0)
    rollout = torch.randn(8, 50) - 2
    logprobs = (rollout + torch.randn(8, 50) * 1.5).requires_grad_(True)
    rollout[:, :3] = float("nan")  # rollout log-probs off action tokens are never read
    mask = (torch.rand(8, 50) < 0.7).float()
    mask[:, :3] = 0
    adv = torch.randn(8, 50)
    loss, _ = dis_policy_loss(logprobs, rollout, adv, mask, 0.3, 5.0)
    loss.backward()
    ratio = (logprobs.detach() - rollout).exp()
    keep = mask.bool() & (ratio > 0.7) & (ratio < 6.0)
    assert keep.any() and (mask.bool() & ~keep).any()
    assert torch.all(logprobs.grad[~keep] == 0)
    expected = -(ratio * adv / mask.sum())[keep]
    torch.testing.assert_close(logprobs.grad[keep], expected)


def test_dis_huge_log_ratio_is_masked_without_nan():
    rollout = torch.tensor([[-100.0, -1.0]])
    logprobs = torch.tensor([[0.0, -1.0]], requires_grad=True)  # ratio e^100 on the first token
    loss, metrics = dis_policy_loss(logprobs, rollout, torch.ones(1, 2), torch.ones(1, 2), 0.3, 5.0)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 0] == 0
    assert loss.item() == pytest.approx(-0.5)
    assert metrics["dis/masked_frac_high"].item() == pytest.approx(0.5)


def test_ppo_clip_hand_computed():
    # ratios [0.5, 1.0, 1.5], A = [1, -1, 2], clip 0.2:
    #   t0: min(0.5 * 1, 0.8 * 1) = 0.5;  t1: -1;  t2: min(1.5 * 2, 1.2 * 2) = 2.4
    #   loss = -(0.5 - 1 + 2.4) / 3 = -0.633333; clipped (the min picks the clipped term) only at t2.
    old = torch.zeros(1, 3)
    logprobs = torch.log(torch.tensor([[0.5, 1.0, 1.5]])).requires_grad_(True)
    loss, metrics = ppo_policy_loss(logprobs, old, torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3))
    assert loss.item() == pytest.approx(-1.9 / 3, abs=1e-6)
    assert metrics["policy/clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # Clipped tokens have zero gradient; t0: -ratio * A / 3 = -0.5/3, t1: 1/3.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5 / 3, 1 / 3, 0.0]]))


def test_clipped_value_loss_hand_computed():
    # t0: (1 - 2)^2 = 1; v_clip = 0.5 + clamp(0.5, -0.2, 0.2) = 0.7 -> (0.7 - 2)^2 = 1.69; max 1.69
    # t1: unchanged value, both errors 1.   loss = 0.5 * (1.69 + 1) / 2 = 0.6725
    values = torch.tensor([[1.0, 0.0, 3.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = clipped_value_loss(values, old, returns, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.6725)
    assert metrics["critic/clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # The clipped branch wins at t0, so its gradient is 0 (v_clip does not depend on values there);
    # t1: 0.5 * 2 * (0 - 1) / 2 = -0.5; t2 is masked.
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.5, 0.0]]))
    plain, _ = clipped_value_loss(values, old, returns, mask, clip_eps=None)
    assert plain.item() == pytest.approx(0.5 * (1 + 1) / 2)


def test_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="advantages shape"):
        dis_policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3), 0.3, 5.0)


def test_value_clip_frac_ignores_rounding_inside_the_window():
    # Inside the window old + (values - old) equals values only up to rounding; that is not clipping.
    gen = torch.Generator().manual_seed(0)
    old = torch.rand(4, 64, generator=gen)
    values = old + (torch.rand(4, 64, generator=gen) - 0.5) * 0.3  # |values - old| <= 0.15 < 0.2
    returns = torch.rand(4, 64, generator=gen)
    mask = torch.ones(4, 64)
    _, metrics = clipped_value_loss(values, old, returns, mask, clip_eps=0.2)
    assert metrics["critic/clip_frac"].item() == 0.0


def test_the_kl_anchor_is_k3_toward_the_reference_and_pulls_from_either_side():
    # Three action tokens and a non-action one. d = reference - current: log(1/2), 0, log 2, and 5 (masked out).
    #   k3 = e^d - 1 - d: 0.5 - 1 + 0.693147 = 0.193147; 0; 2 - 1 - 0.693147 = 0.306853  -> mean 0.166667
    #   d k3 / d current = (1 - e^d) / 3: +0.5/3 (above the reference: pushed down by descent), 0, -1/3 (below: up)
    current = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.1), -6.0]], dtype=torch.float64)
    reference = current + torch.tensor([[math.log(0.5), 0.0, math.log(2.0), 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.float64)
    current.requires_grad_(True)
    kl = anchor_kl(current, reference, mask)
    kl.backward()
    assert kl.item() == pytest.approx((0.193147 + 0.306853) / 3, abs=1e-6)
    torch.testing.assert_close(current.grad, torch.tensor([[0.5 / 3, 0.0, -1.0 / 3, 0.0]], dtype=torch.float64))
    assert anchor_kl(reference, reference, mask).item() == 0.0  # no pull where the policy is the reference
    with pytest.raises(ValueError, match="reference_logprobs shape"):
        anchor_kl(current, reference[:, :2], mask)
