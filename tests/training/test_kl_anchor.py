"""The KL anchor to the SFT policy (`algo.kl_anchor`, docs/design.md section 2): the reference's log-probs are the
SFT policy's whatever the micro-batching, the anchor is zero while the policy is the SFT policy, it keeps a policy
trained on the same batches closer to the SFT policy, and it is refused where the reference cannot be held."""

import copy
from dataclasses import replace

import pytest
import torch

from components.algo import anchor_kl
from components.config import load_config
from components.contracts.trajectory import to_tensors
from components.models.logprobs import token_logprobs
from components.training.engines.engine import TorchEngine
from components.training.engines.settings import EngineSettings
from components.training.rl.algorithms import settings_from
from components.training.rl.learner import Learner
from components.training.rl.passes import reference_logprobs
from components.training.rl.step import train_step


@pytest.fixture
def rows(sft_policy, grouped_trajectories):
    rows = to_tensors(grouped_trajectories, sft_policy[1].pad_token_id)
    last = rows["action_mask"].shape[1] - 1 - rows["action_mask"].flip(1).argmax(dim=1)
    rows["rewards"].zero_()
    rows["rewards"][torch.arange(len(last)), last] = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 0])
    return rows


def test_the_references_log_probs_do_not_depend_on_the_micro_batches(sft_policy, rows):
    reference = copy.deepcopy(sft_policy[0]).eval()
    whole = reference_logprobs(reference, rows, settings_from(load_config("tiny-cpu", [])))
    small = reference_logprobs(reference, rows, settings_from(load_config("tiny-cpu", ["train.micro_batch_tokens=64"])))
    with torch.no_grad():
        direct = token_logprobs(reference, rows["input_ids"], 1.0, rows["attention_mask"])
    act = rows["action_mask"].bool()
    torch.testing.assert_close(small[act], whole[act], rtol=0, atol=1e-5)
    torch.testing.assert_close(whole[act], direct[act], rtol=0, atol=1e-5)


def _train(policy_model, rows, s, steps: int) -> list[dict]:
    policy = TorchEngine(policy_model, EngineSettings(3e-3))
    return [train_step(policy, None, rows, s, {}) for _ in range(steps)]


def test_the_anchor_is_zero_at_the_sft_policy_and_holds_the_policy_near_it(sft_policy, rows):
    """Running-mean SAO (no critic) on the same batch six times, anchored (weight 2) and not: at the first step the
    policy is the reference, so the anchor is ~0 and the loss is the unanchored one; after six steps the anchored
    policy's KL to the SFT policy on the batch's tokens is smaller."""
    reference = copy.deepcopy(sft_policy[0]).eval()
    base = ['train.algo="sao-running-mean"']
    plain, anchored = (settings_from(load_config("tiny-cpu", base + extra)) for extra in ([], ["algo.kl_anchor=2.0"]))
    batch = {**rows, "reference_logprobs": reference_logprobs(reference, rows, anchored)}
    free_model, held_model = copy.deepcopy(sft_policy[0]), copy.deepcopy(sft_policy[0])
    free, held = _train(free_model, batch, plain, 6), _train(held_model, batch, anchored, 6)
    assert "policy/kl_anchor" not in free[0]
    assert held[0]["policy/kl_anchor"].item() == pytest.approx(0.0, abs=1e-6)
    assert held[0]["policy/loss"].item() == pytest.approx(free[0]["policy/loss"].item(), abs=1e-6)
    act = rows["action_mask"]

    def kl_to_reference(model) -> float:
        with torch.no_grad():
            logprobs = token_logprobs(model, rows["input_ids"], 1.0, rows["attention_mask"])
        return anchor_kl(logprobs, batch["reference_logprobs"], act).item()

    drift_free, drift_held = kl_to_reference(free_model), kl_to_reference(held_model)
    assert drift_free > 1e-4  # the batch moved the policy
    assert drift_held < 0.8 * drift_free, (drift_held, drift_free)
    assert held[-1]["policy/kl_anchor"].item() > 0.0


def test_the_learner_holds_the_sft_policy_and_refuses_zero_3(tiny_cfg, sft_dir, rows):
    cfg = load_config("tiny-cpu", ["algo.kl_anchor=0.5", 'train.backend="torch"', "train.threads=1"])
    cfg = replace(cfg, model=tiny_cfg.model)
    learner = Learner(cfg, sft_dir, settings_from(cfg), threads=1)
    assert learner.reference is not None and not any(p.requires_grad for p in learner.reference.parameters())
    metrics = learner.step(dict(rows))
    assert metrics["policy/kl_anchor"].item() == pytest.approx(0.0, abs=1e-6)  # the first step starts at the SFT policy
    zero3 = load_config("tiny-cpu", ["algo.kl_anchor=0.5", 'train.backend="deepspeed"', "train.zero_stage=3"])
    with pytest.raises(ValueError, match=r"^algo\.kl_anchor: 0\.5 holds a whole copy .* ZeRO stage 3"):
        Learner(zero3, sft_dir, settings_from(zero3), threads=1)
