"""Micro-batches (components/training/engines/micro.py) and activation checkpointing: how rows are split, and that a step
in 4 micro-batches, or with activations recomputed, is the step of the whole batch. Real tiny policy and critic,
real rollouts of the SFT policy, on the torch engine and on DeepSpeed at every ZeRO stage."""

import copy
import math
from dataclasses import replace

import deepspeed
import pytest
import torch

from components.contracts.trajectory import to_tensors
from components.models import ValueModel, freeze_attention
from components.training.engines.engine import DeepSpeedEngine, TorchEngine
from components.training.engines.loading import enable_activation_checkpointing
from components.training.engines.micro import MicroBatches, split_rows, spread
from components.training.engines.settings import EngineSettings
from components.training.rl.passes import PolicyPasses, critic_updates, policy_update
from components.training.rl.step import train_step
from tests.training.test_algorithms import SETTINGS

ENGINES = {
    "torch": lambda module, lr: TorchEngine(module, EngineSettings(lr)),
    "zero0": lambda module, lr: DeepSpeedEngine(module, EngineSettings(lr, zero_stage=0)),
    "zero1": lambda module, lr: DeepSpeedEngine(module, EngineSettings(lr, zero_stage=1)),
    "zero2": lambda module, lr: DeepSpeedEngine(module, EngineSettings(lr, zero_stage=2)),
    "zero3": lambda module, lr: DeepSpeedEngine(module, EngineSettings(lr, zero_stage=3)),
}


def test_rows_are_split_within_the_budget_and_spread_to_a_count():
    # Lengths 3, 5, 2, 4 with 10 padded tokens a part: [3, 5] is 2 x 5 = 10 (fits), adding 2 makes 3 x 5 = 15;
    # [2, 4] is 2 x 4 = 8.
    assert split_rows([3, 5, 2, 4], 10) == [range(0, 2), range(2, 4)]
    # A row longer than the budget stands alone; budget 0 is one part.
    assert split_rows([3, 12, 2], 10) == [range(0, 1), range(1, 2), range(2, 3)]
    assert split_rows([3, 12, 2], 0) == [range(0, 3)]
    # Spread to 4 parts: the largest part (rows 0-4) is halved first, then the largest again.
    assert spread([range(0, 5), range(5, 6)], 4) == [range(0, 2), range(2, 3), range(3, 5), range(5, 6)]
    assert spread([range(0, 1)], 3) == [range(0, 1)]  # one row cannot be split: the rest are empty passes


def test_a_plan_trims_parts_and_shares_sum_to_one(batch):
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    budget = 2 * max(lengths)  # two rows a part at most
    micro = MicroBatches.plan(batch, budget)
    assert len(micro) == 4 and not micro.whole
    for i, rows in enumerate(micro.parts):
        part = micro.take(batch, i)
        assert part["input_ids"].shape == (len(rows), max(lengths[rows.start : rows.stop]))
    assert float(sum(micro.share(i) for i in range(len(micro)))) == pytest.approx(1.0, abs=1e-7)
    whole = MicroBatches.plan(batch, 0)
    assert whole.whole and whole.take(batch, 0) is batch and whole.share(0) == 1.0


@pytest.fixture(scope="module")
def batch(sft_policy, grouped_trajectories):
    """8 rollouts of the SFT policy of different lengths, rewards 1/0 on their last action token."""
    tensors = to_tensors(grouped_trajectories, sft_policy[1].pad_token_id)
    last = tensors["action_mask"].shape[1] - 1 - tensors["action_mask"].flip(1).argmax(dim=1)
    tensors["rewards"].zero_()
    tensors["rewards"][torch.arange(8), last] = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 0])
    return tensors


def _engines(make, policy_model, checkpointing: bool = False):
    policy_model = copy.deepcopy(policy_model)
    torch.manual_seed(1)  # the value head's initialisation
    critic_model = ValueModel.from_policy(policy_model)
    freeze_attention(critic_model)
    if checkpointing:
        enable_activation_checkpointing(policy_model)
        enable_activation_checkpointing(critic_model)
    return make(policy_model, 1e-3), make(critic_model, 1e-2)


def _weights(*engines) -> torch.Tensor:
    """Every weight of the engines, whole (gathered from ZeRO-3's partitions)."""
    return torch.cat([v.flatten().float() for e in engines for part in e.full_state() for _, v in sorted(part.items())])


def _record_gradients(engine) -> list:
    """Keep, at every update, the gradient the engine is about to apply (accumulated over the micro-batches and, for
    ZeRO-1/2/3, reduced into partitions: read back whole with DeepSpeed's `safe_get_full_grad`)."""
    seen, update = [], engine._step

    def step():
        params = [p for p in engine.module.parameters() if p.requires_grad]
        if getattr(engine, "zero_stage", 0):
            grads = [deepspeed.utils.safe_get_full_grad(p) for p in params]
        else:
            grads = [p.grad for p in params]
        seen.append(
            torch.cat(
                [
                    torch.zeros(p.ds_numel if hasattr(p, "ds_numel") else p.numel())
                    if g is None
                    else g.detach().flatten().float()
                    for p, g in zip(params, grads)
                ]
            )
        )
        return update()

    engine._step = step
    return seen


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_a_step_in_four_micro_batches_is_the_step_of_the_whole_batch(backend, sft_policy, batch):
    """An SAO step (K = 2 critic updates, then the policy) on the whole batch and in 4 micro-batches of at most two
    rows: every update applies the same gradient, and the step reports the same metrics, to 1e-6."""
    budget = 2 * int(batch["attention_mask"].sum(dim=1).max())
    assert len(MicroBatches.plan(batch, budget)) == 4
    runs = {}
    for tokens in (0, budget):
        policy, critic = _engines(ENGINES[backend], sft_policy[0])
        grads = {"policy": _record_gradients(policy), "critic": _record_gradients(critic)}
        metrics = train_step(policy, critic, batch, replace(SETTINGS, micro_batch_tokens=tokens), {})
        runs[tokens] = metrics, grads
    (whole, whole_grads), (micro, micro_grads) = runs[0], runs[budget]
    assert whole.keys() == micro.keys()
    for key in whole:
        assert float(micro[key]) == pytest.approx(float(whole[key]), rel=1e-6, abs=1e-6), (backend, key)
    assert [len(whole_grads[m]) for m in ("critic", "policy")] == [SETTINGS.critic_updates, 1]
    for model in ("critic", "policy"):
        for a, b in zip(whole_grads[model], micro_grads[model]):
            assert a.abs().max() > 1e-3  # a real gradient
            assert (a - b).abs().max() <= 1e-6, (backend, model, (a - b).abs().max())


@pytest.mark.parametrize("backend", sorted(ENGINES))
def test_a_non_finite_micro_batch_skips_the_step_and_leaves_no_trace(backend, sft_policy, batch):
    """A NaN critic value on an action token of the third of 4 micro-batches (a numerical fault in the critic's
    forward): the K critic updates and the policy update are skipped after two micro-batches accumulated, weights
    stay bit-identical, and the next clean step is bit for bit a fresh engine's first step (what the two
    accumulated was discarded)."""
    settings = replace(SETTINGS, micro_batch_tokens=2 * int(batch["attention_mask"].sum(dim=1).max()))
    row = MicroBatches.plan(batch, settings.micro_batch_tokens).parts[2].start
    position = int(batch["action_mask"][row].nonzero().min())
    policy, critic = _engines(ENGINES[backend], sft_policy[0])
    start = _weights(policy, critic)
    calls = []

    def poison(module, inputs, out):
        calls.append(1)
        if len(calls) == 3:  # the third micro-batch of the first update; its first row is `row`
            out = out.clone()
            out[0, position] = math.nan
        return out

    handle = critic.module.register_forward_hook(poison)
    metrics = train_step(policy, critic, batch, settings, {})
    handle.remove()
    assert math.isnan(metrics["critic/grad_norm"]) and math.isnan(metrics["policy/grad_norm"])
    assert (policy.skipped_steps, critic.skipped_steps) == (1, settings.critic_updates)
    assert torch.equal(_weights(policy, critic), start)
    after = train_step(policy, critic, batch, settings, {})
    ref_policy, ref_critic = _engines(ENGINES[backend], sft_policy[0])
    reference = train_step(ref_policy, ref_critic, batch, settings, {})
    assert all(torch.equal(torch.as_tensor(after[k]), torch.as_tensor(reference[k])) for k in reference), [
        (k, float(after[k]), float(reference[k]))
        for k in reference
        if not torch.equal(torch.as_tensor(after[k]), torch.as_tensor(reference[k]))
    ]
    assert torch.equal(_weights(policy, critic), _weights(ref_policy, ref_critic))


@pytest.mark.parametrize("backend", ["torch", "zero3"])
def test_activation_checkpointing_changes_no_number(backend, sft_policy, batch):
    """The same two SAO steps with every decoder layer recomputed in the backward pass: the same metrics and
    weights, bit for bit."""
    runs = []
    for checkpointing in (False, True):
        policy, critic = _engines(ENGINES[backend], sft_policy[0], checkpointing)
        metrics = [train_step(policy, critic, batch, SETTINGS, {}) for _ in range(2)]
        runs.append((metrics, _weights(policy, critic)))
    (plain, plain_weights), (recomputed, recomputed_weights) = runs
    for a, b in zip(plain, recomputed):
        assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a), backend
    assert torch.equal(plain_weights, recomputed_weights)


def test_a_model_with_dropout_is_refused_for_activation_checkpointing(sft_policy):
    model = copy.deepcopy(sft_policy[0])
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"train\.activation_checkpointing: the model has dropout .*attention_dropout"):
        enable_activation_checkpointing(model)


@pytest.mark.parametrize("tokens", [0, "two rows"])
def test_a_policy_update_begun_before_its_advantages_is_the_update_begun_after(tokens, sft_policy, batch):
    """The overlap with a critic on ranks of its own (placement.py): the policy's micro-batches planned and its first
    forward pass run, then the critic's K updates, then the advantages and the rest of the update, give the weights
    and metrics of the update run in one go, bit for bit; non-finite advantages skip a begun update and leave the
    weights as they were."""
    budget = 2 * int(batch["attention_mask"].sum(dim=1).max()) if tokens else 0
    s = replace(SETTINGS, micro_batch_tokens=budget)
    torch.manual_seed(3)
    advantages = torch.randn(batch["action_mask"].shape) * batch["action_mask"]
    runs = []
    for early in (False, True):
        policy, critic = _engines(ENGINES["torch"], sft_policy[0])
        begun = PolicyPasses(policy, batch, s) if early else None
        critic_updates(critic, batch, s, s.critic_updates)  # what the critic ranks do meanwhile
        runs.append((policy_update(policy, batch, advantages, s, begun=begun), _weights(policy)))
    (metrics, weights), (early_metrics, early_weights) = runs
    assert torch.equal(weights, early_weights)
    assert metrics.keys() == early_metrics.keys()
    assert all(torch.equal(torch.as_tensor(metrics[k]), torch.as_tensor(early_metrics[k])) for k in metrics)
    assert len(PolicyPasses(policy, batch, s).micro) == (4 if tokens else 1)

    policy, _ = _engines(ENGINES["torch"], sft_policy[0])
    before, begun = _weights(policy), PolicyPasses(policy, batch, s)
    skipped = policy_update(
        policy, batch, advantages.masked_fill(batch["action_mask"].bool(), math.nan), s, begun=begun
    )
    assert math.isnan(float(skipped["policy/grad_norm"])) and policy.skipped_steps == 1
    assert torch.equal(_weights(policy), before)
