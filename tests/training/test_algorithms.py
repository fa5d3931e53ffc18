"""Every algorithm's step on a real batch of tiny-policy rollouts: what moves, what stays, which metrics."""

import copy

import pytest
import torch

from components.algo import clipped_value_loss, gae
from components.config import load_config
from components.contracts.metrics import ALGORITHM_METRICS, DIAGNOSTIC_METRICS
from components.contracts.trajectory import to_tensors
from components.models import ValueModel, freeze_attention
from components.training.engines.engine import TorchEngine
from components.training.engines.settings import EngineSettings
from components.training.rl.algorithms import ALGORITHMS, AlgoSettings, settings_from
from components.training.rl.step import policy_advantages, train_step

DESIGN_METRICS = {*ALGORITHM_METRICS, *DIAGNOSTIC_METRICS}


@pytest.fixture(scope="module")
def batch(sft_policy, grouped_trajectories):
    """Two prompts x 4 rollouts each (so GRPO has two groups), sampled at T = 1 by the SFT policy."""
    tokenizer = sft_policy[1]
    trajectories = grouped_trajectories
    tensors = to_tensors(trajectories, tokenizer.pad_token_id)
    # Rewards varied within each group on purpose: with equal rewards a GRPO group has no signal at all.
    last = tensors["action_mask"].shape[1] - 1 - tensors["action_mask"].flip(1).argmax(dim=1)
    tensors["rewards"].zero_()
    tensors["rewards"][torch.arange(8), last] = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 0])
    return tensors


SETTINGS = AlgoSettings(
    gamma=1.0,
    lam_critic=1.0,
    lam_policy=0.95,
    eps_low=0.3,
    eps_high=5.0,
    temperature=1.0,
    critic_updates=2,
    value_clip=0.2,
    normalize_advantages=False,
    group_size=4,
)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_each_algorithm_updates_what_it_should(name, sft_policy, batch):
    algorithm = ALGORITHMS[name]
    policy_model = copy.deepcopy(sft_policy[0])
    policy = TorchEngine(policy_model, EngineSettings(1e-3))
    critic, frozen = None, set()
    if algorithm.uses_critic:
        critic_model = ValueModel.from_policy(policy_model)
        if algorithm.freeze_critic_attention:
            frozen = set(freeze_attention(critic_model))
        critic = TorchEngine(critic_model, EngineSettings(1e-2))
        critic_before = {n: p.detach().clone() for n, p in critic_model.named_parameters()}
    policy_before = {n: p.detach().clone() for n, p in policy_model.named_parameters()}
    settings = AlgoSettings(
        **{
            **SETTINGS.__dict__,
            "critic_updates": algorithm.critic_updates or SETTINGS.critic_updates,
            "advantage": algorithm.advantage,
            "loss": algorithm.loss,
        }
    )
    metrics = train_step(policy, critic, batch, settings, {})
    assert set(metrics) >= {"policy/loss", "policy/entropy", "policy/grad_norm", "adv/mean", "adv/std"}
    assert all(torch.isfinite(torch.as_tensor(v)) for k, v in metrics.items() if k != "critic/explained_variance")
    assert set(metrics) - {"policy/clip_frac", "critic/clip_frac"} <= DESIGN_METRICS
    moved = [n for n, p in policy_model.named_parameters() if not torch.equal(p, policy_before[n])]
    assert moved, "the policy did not move"
    if critic is not None:
        assert {"critic/loss", "critic/explained_variance", "critic/grad_norm"} <= set(metrics)
        params = dict(critic.module.named_parameters())
        assert all(torch.equal(params[n], critic_before[n]) for n in frozen)
        assert not torch.equal(params["value_head.weight"], critic_before["value_head.weight"])
        if not algorithm.freeze_critic_attention:
            assert not torch.equal(
                params["backbone.layers.0.self_attn.q_proj.weight"],
                critic_before["backbone.layers.0.self_attn.q_proj.weight"],
            )
    if name in ("sao", "sao-k1", "sao-full-critic", "sao-running-mean", "grpo-dis"):
        assert {"dis/masked_frac_low", "dis/masked_frac_high", "dis/ratio_mean", "dis/approx_kl"} <= set(metrics)
        # On-policy data (no lag): every ratio is 1, nothing is masked.
        assert metrics["dis/masked_frac_low"] == 0 and metrics["dis/masked_frac_high"] == 0
        assert abs(float(metrics["dis/ratio_mean"]) - 1) < 1e-4


def test_the_critic_step_shares_v_old_with_its_first_update(sft_policy, batch):
    """K updates cost K + 1 critic forwards: V_old is the first update's forward (same weights), and the values
    handed to the advantages are one forward of the updated critic, equal to computing them afresh."""
    from components.training.rl.passes import critic_updates

    model = ValueModel.from_policy(copy.deepcopy(sft_policy[0]))
    freeze_attention(model)
    critic = TorchEngine(model, EngineSettings(1e-2))
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    values, metrics = critic_updates(critic, batch, SETTINGS, SETTINGS.critic_updates)
    handle.remove()
    assert calls == [True] * SETTINGS.critic_updates + [False]
    with torch.no_grad():
        assert torch.equal(values, model(batch["input_ids"], batch["attention_mask"]))
    assert torch.isfinite(metrics["critic/grad_norm"])


def test_every_configurable_algorithm_is_defined_once():
    """`train.algo`'s choices are `AlgoName` (components/config/fields.py); ALGORITHMS defines exactly those."""
    import typing

    from components.config import AlgoName
    from components.training.rl.algorithms import ALGORITHMS

    assert set(ALGORITHMS) == set(typing.get_args(AlgoName))


def _reference_critic(model, batch, updates: int, lr: float):
    """`updates` AdamW steps (betas (0.9, 0.95), clip 1.0) of the clipped value loss against one set of targets:
    V_old and the GAE returns from the critic before its first update, written out here from docs/design.md
    section 2 rather than through `critic_updates`."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    mask = batch["action_mask"]
    with torch.no_grad():
        old = model(batch["input_ids"], batch["attention_mask"])
    returns = gae(batch["rewards"], old, mask, SETTINGS.gamma, SETTINGS.lam_critic)[1]
    for _ in range(updates):
        loss, _ = clipped_value_loss(model(batch["input_ids"], batch["attention_mask"]), old, returns, mask, 0.2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("name", "updates"), [("sao", 2), ("sao-k1", 1)])
def test_one_sao_step_makes_k_critic_updates_with_attention_frozen(name, updates, sft_policy, batch):
    """One step of `sao` (K = 2 from the config) and of `sao-k1` leaves the critic exactly where K AdamW steps on
    the same targets put it, so the two are told apart by their weights; the attention weights have not moved and
    the MoE experts, router and value head have."""
    settings = AlgoSettings(
        **{
            **SETTINGS.__dict__,
            "critic_updates": settings_from(load_config("tiny-cpu", [f'train.algo="{name}"'])).critic_updates,
        }
    )
    assert settings.critic_updates == updates
    start = ValueModel.from_policy(copy.deepcopy(sft_policy[0]))
    frozen = set(freeze_attention(start))
    before = {n: p.detach().clone() for n, p in start.named_parameters()}
    model = copy.deepcopy(start)
    policy = TorchEngine(copy.deepcopy(sft_policy[0]), EngineSettings(1e-3))
    train_step(policy, TorchEngine(model, EngineSettings(1e-2)), batch, settings, {})
    after = {n: p.detach() for n, p in model.named_parameters()}

    expected = _reference_critic(copy.deepcopy(start), batch, updates, 1e-2)
    for n in after:
        torch.testing.assert_close(after[n], expected[n], rtol=0, atol=1e-6, msg=n)
    other = _reference_critic(copy.deepcopy(start), batch, 3 - updates, 1e-2)
    assert not torch.allclose(after["value_head.weight"], other["value_head.weight"], rtol=0, atol=1e-5)

    assert frozen and all(torch.equal(after[n], before[n]) for n in frozen)
    moved = {n for n in after if not torch.equal(after[n], before[n])}
    assert any(".mlp.experts." in n for n in moved) and any(".mlp.gate." in n for n in moved)
    assert "value_head.weight" in moved and not moved & frozen


def test_algo_skip_observations_reaches_the_policys_advantages():
    # One row: action, observation, action, action; reward 1 on the last token; gamma 1, lam_policy 0.95.
    # Skip-observation GAE: deltas 0.4 - 0.2 = 0.2 (token 0 bootstraps from token 2), 0.6 - 0.4 = 0.2, 1 - 0.6 = 0.4;
    # A = [0.2 + 0.95 * 0.58, 0, 0.2 + 0.95 * 0.4, 0.4] = [0.751, 0, 0.58, 0.4].
    # Through the observation: token 1 is a timestep with delta 0.4 - 0.5 = -0.1, A_1 = -0.1 + 0.95 * 0.58 = 0.451,
    # token 0's delta is 0.5 - 0.2 = 0.3, A_0 = 0.3 + 0.95 * 0.451 = 0.72845 (zeroed on the observation).
    batch = {"rewards": torch.tensor([[0.0, 0.0, 0.0, 1.0]]), "action_mask": torch.tensor([[1, 0, 1, 1]])}
    values = torch.tensor([[0.2, 0.5, 0.4, 0.6]])
    expected = {True: [0.751, 0.0, 0.58, 0.4], False: [0.72845, 0.0, 0.58, 0.4]}
    for skip, want in expected.items():
        s = settings_from(load_config("tiny-cpu", [f"algo.skip_observations={str(skip).lower()}"]))
        assert s.skip_observations is skip
        assert policy_advantages(batch, values, s)[0].tolist() == pytest.approx(want, abs=1e-6)
