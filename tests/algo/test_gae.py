"""Skip-observation GAE: hand-computed cases, invariances, and fast == reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from components.algo import discounted_reverse_cumsum, gae, gae_reference

IMPLS = [gae, gae_reference]

# Two action segments with a tool observation between them:
#   pos:     0       1     2     3     4     5     6
#   kind:  prompt   act   act   obs   obs   act   act (last; outcome reward 1)
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 1]], dtype=torch.float32)
VALUES = torch.tensor([[9.0, 0.5, 0.4, 7.0, 7.0, 0.6, 0.8]])
REWARDS = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])


@pytest.mark.parametrize("impl", IMPLS)
def test_two_segments_skip_observations(impl):
    # gamma = 1, lam = 0.5. next(2) = 5: the recursion jumps over the observation tokens 3 and 4.
    #   t=6: delta = 1 + 0 - 0.8 = 0.2                 A6 = 0.2
    #   t=5: delta = 0 + 0.8 - 0.6 = 0.2               A5 = 0.2 + 0.5 * 0.2  = 0.3
    #   t=2: delta = 0 + V(5) - V(2) = 0.6 - 0.4 = 0.2 A2 = 0.2 + 0.5 * 0.3  = 0.35
    #   t=1: delta = 0 + 0.4 - 0.5 = -0.1              A1 = -0.1 + 0.5 * 0.35 = 0.075
    # R_t = A_t + V_t: R1 = 0.575, R2 = 0.75, R5 = 0.9, R6 = 1.0; zero off action tokens.
    adv, ret = impl(REWARDS, VALUES, MASK, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0, 0.075, 0.35, 0, 0, 0.3, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0, 0.575, 0.75, 0, 0, 0.9, 1.0]]))


@pytest.mark.parametrize("impl", IMPLS)
def test_two_segments_through_observations(impl):
    # Ablation: positions 1..6 are all timesteps; the observations use the critic's own values (7) and reward 0.
    #   t=6: A6 = 0.2;  t=5: A5 = 0.3 (as above)
    #   t=4: delta = 0 + V(5) - V(4) = 0.6 - 7 = -6.4    A4 = -6.4 + 0.5 * 0.3     = -6.25
    #   t=3: delta = 0 + 7 - 7 = 0                      A3 = 0 + 0.5 * -6.25      = -3.125
    #   t=2: delta = 0 + V(3) - V(2) = 7 - 0.4 = 6.6     A2 = 6.6 + 0.5 * -3.125   = 5.0375
    #   t=1: delta = 0.4 - 0.5 = -0.1                   A1 = -0.1 + 0.5 * 5.0375  = 2.41875
    # Output is zeroed on the observation tokens; R1 = 2.91875, R2 = 5.4375.
    adv, ret = impl(REWARDS, VALUES, MASK, gamma=1.0, lam=0.5, skip_observations=False)
    torch.testing.assert_close(adv, torch.tensor([[0, 2.41875, 5.0375, 0, 0, 0.3, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0, 2.91875, 5.4375, 0, 0, 0.9, 1.0]]))


@pytest.mark.parametrize("impl", IMPLS)
def test_discount_and_lambda_zero(impl):
    # One segment, V = 0, reward 1 on the last of three tokens, gamma = 0.5, lam = 1:
    #   A2 = 1;  A1 = 0 + 0.5 * A2 = 0.5;  A0 = 0.25.
    mask = torch.ones(1, 3)
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    adv, _ = impl(rewards, torch.zeros(1, 3), mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.5, 1.0]]))
    # lam = 0 makes A the one-step TD error: A_t = r_t + gamma V_next - V_t with V = [1, 2, 3]:
    #   A0 = 0 + 0.5 * 2 - 1 = 0;  A1 = 0 + 0.5 * 3 - 2 = -0.5;  A2 = 1 + 0 - 3 = -2.
    values = torch.tensor([[1.0, 2.0, 3.0]])
    adv, ret = impl(rewards, values, mask, gamma=0.5, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.5, -2.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.5, 1.0]]))


@pytest.mark.parametrize("impl", IMPLS)
def test_values_at_observation_positions_do_not_matter(impl):
    torch.manual_seed(0)
    mask, rewards, values = _random_batch(6, 97, torch.float32)
    adv, ret = impl(rewards, values, mask, gamma=1.0, lam=0.95)
    noisy = torch.where(mask.bool(), values, torch.randn_like(values) * 100)
    noisy[0, ~mask[0].bool()] = float("nan")  # even NaN off the action tokens changes nothing
    adv2, ret2 = impl(rewards, noisy, mask, gamma=1.0, lam=0.95)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_without_actions_are_zero(impl):
    mask = torch.tensor([[0, 0, 0], [0, 1, 1]], dtype=torch.float32)
    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    values = torch.full((2, 3), 0.5)
    for skip in (True, False):
        adv, ret = impl(rewards, values, mask, 1.0, 1.0, skip)
        assert torch.equal(adv[0], torch.zeros(3)) and torch.equal(ret[0], torch.zeros(3))
        torch.testing.assert_close(adv[1], torch.tensor([0.0, 0.5, 0.5]))  # A = 1 - 0.5 at both tokens
    adv, ret = impl(torch.zeros(2, 3), values, torch.zeros(2, 3), 1.0, 1.0)
    assert not adv.any() and not ret.any()


def test_rejects_reward_off_action_tokens_and_bad_shapes():
    rewards = REWARDS.clone()
    rewards[0, 3] = 1.0  # a reward on an observation token would be silently dropped
    with pytest.raises(ValueError, match="rewards must be 0 where action_mask == 0"):
        gae(rewards, VALUES, MASK, 1.0, 1.0)
    with pytest.raises(ValueError, match="values shape"):
        gae(REWARDS, VALUES[:, :3], MASK, 1.0, 1.0)
    with pytest.raises(ValueError, match="lam"):
        gae(REWARDS, VALUES, MASK, 1.0, 1.5)


def test_discounted_reverse_cumsum_spans_several_scan_levels():
    # T = 5000 > 64 * 64 exercises two levels of the chunked scan.
    torch.manual_seed(1)
    x = torch.randn(3, 5000, dtype=torch.float64)
    factor = 0.99
    expected = torch.zeros_like(x)
    acc = torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(x.shape[1])):
        acc = x[:, t] + factor * acc
        expected[:, t] = acc
    torch.testing.assert_close(discounted_reverse_cumsum(x, factor), expected, rtol=0, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 5),
    length=st.integers(1, 400),
    action_p=st.floats(0.0, 1.0),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    skip=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_fast_equals_reference_on_random_ragged_masks(batch, length, action_p, gamma, lam, skip, seed):
    gen = torch.Generator().manual_seed(seed)
    mask, rewards, values = _random_batch(batch, length, torch.float32, action_p, gen)
    fast = gae(rewards, values, mask, gamma, lam, skip)
    ref = gae_reference(rewards, values, mask, gamma, lam, skip)
    for got, want in zip(fast, ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _random_batch(batch, length, dtype, action_p=0.6, gen=None):
    """Ragged rows: random action/observation runs, right padding, the outcome reward on each last action."""
    mask = (torch.rand(batch, length, generator=gen) < action_p).to(dtype)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    mask[torch.arange(length)[None, :] >= lengths[:, None]] = 0  # padding
    rewards = torch.randn(batch, length, generator=gen, dtype=dtype) * 0.1 * mask  # dense shaping rewards
    values = torch.randn(batch, length, generator=gen, dtype=dtype)
    return mask, rewards, values
