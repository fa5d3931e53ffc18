"""The safeguards the public SAO ports added, as options (docs/design.md section 2, "Safeguards"): length-adaptive
lambda, whitening while the critic explains little, the critic's own gradient clip, critic-only warm-up steps and
eviction by the oldest token's lag. Each against numbers computed by hand."""

import asyncio
import copy

import pytest
import torch

from components.algo import gae, gae_by_row, length_adaptive_lambda
from components.config import ConfigError, load_config
from components.contracts.task import Task
from components.contracts.trajectory import to_tensors
from components.models import ValueModel, freeze_attention
from components.training.engines.collective import SOLO
from components.training.engines.engine import TorchEngine
from components.training.engines.settings import EngineSettings
from components.training.rl.algorithms import settings_from
from components.training.rl.buffer import TrajectoryBuffer
from components.training.rl.passes import Mismatch
from components.training.rl.step import policy_advantages, train_step, whitens
from tests.factories import trajectory


def test_length_adaptive_lambda_is_one_minus_one_over_alpha_l_clamped():
    # alpha 0.25: l = 8 -> 1 - 1/2 = 0.5; l = 2 -> 1 - 2 = -1 -> 0; l = 40 -> 1 - 1/10 = 0.9; no action token -> 0
    mask = torch.zeros(4, 40)
    for row, length in enumerate((8, 2, 40, 0)):
        mask[row, :length] = 1
    assert length_adaptive_lambda(mask, 0.25).tolist() == pytest.approx([0.5, 0.0, 0.9, 0.0])
    with pytest.raises(ValueError, match="alpha must be > 0"):
        length_adaptive_lambda(mask, 0.0)


def test_the_policy_gets_each_rows_own_lambda():
    # gamma 1, alpha 1. Row 0: two action tokens -> lam 1 - 1/2 = 0.5; rewards [0, 1], values [0.5, 0.8]:
    #   deltas 0.8 - 0.5 = 0.3 and 1 - 0.8 = 0.2; A = [0.3 + 0.5 * 0.2, 0.2] = [0.4, 0.2].
    # Row 1: four action tokens -> lam 0.75; reward 1 on the last, values 0.5: deltas [0, 0, 0, 0.5];
    #   A_3 = 0.5, A_2 = 0.375, A_1 = 0.28125, A_0 = 0.2109375.
    batch = {
        "rewards": torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]),
        "action_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
    }
    values = torch.tensor([[0.5, 0.8, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    s = settings_from(load_config("tiny-cpu", ["algo.lam_length_alpha=1.0", "algo.gamma=1.0"]))
    advantages = policy_advantages(batch, values, s)
    assert advantages.tolist() == [pytest.approx([0.4, 0.2, 0, 0]), pytest.approx([0.2109375, 0.28125, 0.375, 0.5])]
    # each row is what gae gives it alone at its lambda
    by_row, _ = gae_by_row(batch["rewards"], values, batch["action_mask"], 1.0, torch.tensor([0.5, 0.75]))
    for row, lam in enumerate((0.5, 0.75)):
        alone, _ = gae(
            batch["rewards"][row : row + 1], values[row : row + 1], batch["action_mask"][row : row + 1], 1.0, lam
        )
        torch.testing.assert_close(by_row[row : row + 1], alone, rtol=0, atol=0)
    # off (alpha 0): lam_policy for every row
    plain = settings_from(load_config("tiny-cpu", ["algo.gamma=1.0", "algo.lam_policy=0.5"]))
    assert policy_advantages(batch, values, plain)[0].tolist() == pytest.approx([0.4, 0.2, 0, 0])


def test_whitening_follows_the_critics_explained_variance():
    # gamma = lam_critic = 1: the returns are the rewards to go, [1, 1] and [0, 0]; their variance over the four
    # action tokens is 0.25. Values 0.5 everywhere leave residuals +-0.5 (variance 0.25): EV = 0, below 0.1, whiten.
    # Values equal to the returns explain everything: EV = 1, no whitening.
    batch = {"rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0]]), "action_mask": torch.tensor([[1, 1], [1, 1]])}
    s = settings_from(load_config("tiny-cpu", ["algo.whiten_below_ev=0.1", "algo.gamma=1.0", "algo.lam_critic=1.0"]))
    poor, perfect = torch.full((2, 2), 0.5), torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert whitens(batch, poor, s) and not whitens(batch, perfect, s)
    whitened = policy_advantages(batch, poor, s, whiten=True)
    assert float(whitened.mean()) == pytest.approx(0.0, abs=1e-6) and float(
        whitened.std(unbiased=False)
    ) == pytest.approx(1.0, abs=1e-3)
    off = settings_from(load_config("tiny-cpu", []))
    assert not whitens(batch, poor, off)  # the default: only normalize_advantages whitens
    always = settings_from(load_config("tiny-cpu", ["algo.normalize_advantages=true"]))
    assert whitens(batch, perfect, always)


def test_the_critic_has_its_own_gradient_clip():
    cfg = load_config("tiny-cpu", ["train.critic_grad_clip=10.0"])
    assert EngineSettings.rl(cfg.train, 1e-3, critic=True).grad_clip == 10.0
    assert EngineSettings.rl(cfg.train, 1e-3).grad_clip == 1.0  # the policy keeps train.grad_clip
    assert EngineSettings.value_pretrain(cfg).grad_clip == 10.0
    assert EngineSettings.rl(cfg.train, 1e-3, critic=True).deepspeed()["gradient_clipping"] == 10.0
    default = load_config("tiny-cpu", [])
    assert EngineSettings.rl(default.train, 1e-3, critic=True).grad_clip == default.train.grad_clip
    # the engine the learner builds from those settings clips the critic at 10
    critic = TorchEngine(torch.nn.Linear(2, 1), EngineSettings.rl(cfg.train, 1e-3, critic=True))
    critic.module.weight.grad = torch.tensor([[12.0, 16.0]])  # norm 20
    critic.module.bias.grad = torch.zeros(1)
    assert critic.grad_clip == 10.0
    assert float(critic.apply()) == pytest.approx(20.0)  # the norm before clipping (critic/grad_norm), then clipped


def test_a_warm_up_step_trains_the_critic_and_leaves_the_policy(sft_policy, grouped_trajectories):
    rows = to_tensors(grouped_trajectories, sft_policy[1].pad_token_id)
    last = rows["action_mask"].shape[1] - 1 - rows["action_mask"].flip(1).argmax(dim=1)
    rows["rewards"].zero_()
    rows["rewards"][torch.arange(len(last)), last] = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 0])
    policy_model = copy.deepcopy(sft_policy[0])
    critic_model = ValueModel.from_policy(policy_model)
    freeze_attention(critic_model)
    policy, critic = TorchEngine(policy_model, EngineSettings(1e-3)), TorchEngine(critic_model, EngineSettings(1e-2))
    policy_before = {n: p.detach().clone() for n, p in policy_model.named_parameters()}
    head_before = critic_model.value_head.weight.detach().clone()
    s = settings_from(load_config("tiny-cpu", []))
    metrics = train_step(policy, critic, rows, s, {}, update_policy=False)
    assert all(torch.equal(p, policy_before[n]) for n, p in policy_model.named_parameters())
    assert not torch.equal(critic_model.value_head.weight, head_before)
    assert "critic/loss" in metrics and not any(k.startswith(("policy/", "dis/")) for k in metrics)
    assert policy.skipped_steps == 0  # a warm-up step is not a skipped update
    after = train_step(policy, critic, rows, s, {})  # after the warm-up: the policy moves
    assert "policy/loss" in after
    assert any(not torch.equal(p, policy_before[n]) for n, p in policy_model.named_parameters())


def test_warm_up_and_eviction_are_refused_where_they_cannot_apply():
    with pytest.raises(ConfigError, match="train.critic_warmup_steps: needs an algorithm with a critic"):
        load_config("tiny-cpu", ['train.algo="grpo"', "train.critic_warmup_steps=5"])
    with pytest.raises(ConfigError, match="train.max_token_lag: evicts single rollouts"):
        load_config("tiny-cpu", ['train.algo="grpo"', "train.max_token_lag=2"])


def test_a_trajectory_older_than_the_lag_is_evicted_and_its_slot_given_back():
    # Version 5, max_token_lag 2: the floor is 3. Oldest tokens at versions 2 (evicted), 3 and 4 (kept).
    async def scenario():
        buffer = TrajectoryBuffer(max_staleness=8, batch_size=2, max_token_lag=2, version=5)
        for i in range(3):
            await buffer.admit(Task(f"t{i}", "q", 0))
        started = buffer.started
        for i, oldest in enumerate((2, 3, 4)):
            await buffer.put(trajectory(prompt_id=f"t{i}", versions=[None, None, oldest, None, oldest + 1]))
        batch = await buffer.take(2)
        return batch, buffer, started

    batch, buffer, started = asyncio.run(scenario())
    assert [t.prompt_id for t in batch] == ["t1", "t2"]
    assert buffer.evicted == 1 and buffer.started == started - 1
    with pytest.raises(ValueError, match="max_token_lag"):
        TrajectoryBuffer(2, 8, group_size=4, max_token_lag=1)


def test_a_group_without_signal_is_dropped_and_its_slots_given_back():
    # Groups of 2: rewards (1, 1) and (0, 0) carry no signal (GRPO's advantages are 0), (1, 0) does.
    async def scenario(drop):
        buffer = TrajectoryBuffer(max_staleness=8, batch_size=2, group_size=2, drop_uniform_groups=drop)
        rewards = {"a": (1.0, 1.0), "b": (0.0, 0.0), "c": (1.0, 0.0)}
        for prompt in rewards:
            for g in range(2):
                await buffer.admit(Task(f"{prompt}#g{g}", "q", 0))
        started = buffer.started
        for prompt, pair in rewards.items():
            for g, reward in enumerate(pair):
                await buffer.put(trajectory(prompt_id=f"{prompt}#g{g}", reward=reward))
        return [t.prompt_id for t in await buffer.take(2)], buffer, started

    kept, buffer, started = asyncio.run(scenario(drop=True))
    assert kept == ["c#g0", "c#g1"] and buffer.groups_dropped == 2 and buffer.started == started - 4
    kept, buffer, _ = asyncio.run(scenario(drop=False))
    assert kept == ["a#g0", "a#g1"] and buffer.groups_dropped == 0
    with pytest.raises(ConfigError, match="train.group_filter: filters GRPO's groups"):
        load_config("tiny-cpu", ['train.group_filter="drop-uniform"'])


def test_the_mismatch_is_k3_over_the_tokens_sampled_at_the_version_trained():
    # Action tokens 1-3; tokens 1 and 2 sampled at version 3 (the one trained), token 3 at version 2 (stale: its
    # difference is lag, not mismatch). Token 1: trainer p = 0.5, engine p = 0.25, r = 2, k3 = 2 - 1 - ln 2 =
    # 0.3068528; token 2: r = 1, k3 = 0. Mean over the two: 0.1534264.
    logprobs = torch.log(torch.tensor([[0.9, 0.5, 0.25, 0.5]]))
    mb = {
        "action_mask": torch.tensor([[0, 1, 1, 1]]),
        "versions": torch.tensor([[-1, 3, 3, 2]]),
        "rollout_logprobs": torch.log(torch.tensor([[1.0, 0.25, 0.25, 0.01]])),
    }
    mismatch = Mismatch(3)
    mismatch.add(logprobs, mb)
    assert float(mismatch.result(SOLO)["rollout/mismatch_kl"]) == pytest.approx(0.1534264, abs=1e-6)
    later = Mismatch(4)  # every token stale: nothing to measure
    later.add(logprobs, mb)
    assert later.result(SOLO) == {} and Mismatch(-1).result(SOLO) == {}
