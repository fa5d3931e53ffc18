"""Value pretraining on the tiny SFT policy: it beats the cold critic on held-out prompts, trains with attention
frozen, saves a critic the learner starts from (`train.critic_path`), and its targets are skip-observation GAE."""

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from components.config import ConfigError, load_config
from components.contracts.trajectory import Timings, Trajectory, to_tensors
from components.models import ValueModel, build_policy, freeze_attention, load_policy
from components.models.value import HEAD_FILE
from components.stages.recipes import PROMPT_SEED_SHIFT, value_pretrain_recipe
from components.stages.value_pretrain import SUMMARY_FILE, pretrain_value
from components.storage import is_complete
from components.training.rl.algorithms import settings_from
from components.training.rl.learner import Learner
from components.training.value_pretrain import split_by_prompt, value_targets


def _pretrain_cfg(tiny_cfg):
    """The tiny config, small. The 200-step fixture policy always calls the tool on a*b+c and is right ~98% of
    the time: almost no reward variance to explain. Half the prompts are two-step problems, which it never
    learnt and fails: the critic has to learn which prompts the policy solves."""
    vp = replace(tiny_cfg.value_pretrain, episodes=64, batch_size=8, max_epochs=8, patience=4)
    return replace(
        tiny_cfg,
        value_pretrain=vp,
        task=replace(tiny_cfg.task, kinds=("affine", "two_step")),
        train=replace(tiny_cfg.train, backend="torch", threads=1),
    )


@pytest.fixture(scope="module")
def pretrained(tiny_cfg, sft_dir, tmp_path_factory):
    cfg = _pretrain_cfg(tiny_cfg)
    log: list[str] = []
    result = pretrain_value(cfg, sft_dir, tmp_path_factory.mktemp("vp") / "critic", log=log.append)
    return cfg, result, log


def test_pretraining_beats_the_cold_critic_and_saves_what_it_measured(pretrained, sft_dir):
    cfg, result, log = pretrained
    # Measured (64 episodes, 48 train / 16 held-out prompts, ~10 s on 2 cores): held-out EV -0.049 cold, 0.060, 0.259,
    # 0.181, 0.601, 0.700, 0.742 after epochs 1-6 on one machine; on another the fixture's policy differs in its last
    # bits and the same seed gives -0.029 cold, 0.020, -0.075, -0.419, -0.032, 0.193, 0.371, 0.467 after epochs 1-7
    # (seeds 1 and 2 there: 0.764 and 0.775 after 8). Patience 4 lets such a dip recover; the margin holds on both.
    assert result.ev_cold == result.ev_history[0] and result.ev_cold < 0.1
    assert result.ev_best > result.ev_cold + 0.3
    assert result.ev_best == max(result.ev_history) == result.ev_history[result.best_epoch]
    assert (result.episodes, result.held_out) == (64, 16)  # round(64 * 0.25)
    # One line for the rollouts, one per epoch (cold included), one for the save.
    assert len(log) == 1 + len(result.ev_history) + 1 and "64 tir_math episodes" in log[0]

    assert is_complete(result.out_dir)
    critic = ValueModel.load(result.out_dir)
    assert critic.backbone.config.hidden_size == cfg.model.hidden_size
    summary = json.loads((result.out_dir / SUMMARY_FILE).read_text())
    assert summary["result"]["ev_history"] == result.ev_history
    assert summary["result"]["best_epoch"] == result.best_epoch
    assert summary["recipe"] == value_pretrain_recipe(cfg, sft_dir)
    assert summary["recipe"]["training"]["task_seed"] == cfg.train.task_seed + PROMPT_SEED_SHIFT
    assert summary["recipe"]["training"]["freeze_attention"] is True  # train.algo = sao


def test_attention_stays_bit_identical_to_the_sft_policy(pretrained, sft_dir):
    _, result, _ = pretrained
    sft = ValueModel.from_policy(load_policy(sft_dir))
    attention = freeze_attention(sft)  # the names training freezes
    before, after = sft.state_dict(), ValueModel.load(result.out_dir).state_dict()
    assert attention and all(torch.equal(after[name], before[name]) for name in attention)
    moved = [
        n for n in after if n not in attention and n.startswith("backbone.") and not torch.equal(after[n], before[n])
    ]
    assert any(".mlp.experts." in n for n in moved) and any(".mlp.gate." in n for n in moved)


def _trajectory(prompt_id: str, token_ids: list[int], mask: list[int], reward: float) -> Trajectory:
    return Trajectory(
        prompt_id,
        "tir_math",
        token_ids,
        mask,
        [-0.5 if m else None for m in mask],
        [0 if m else None for m in mask],
        reward,
        1,
        "stop",
        mask.index(1),
        Timings(0.0),
    )


def test_targets_are_the_outcome_on_every_action_token_with_lam_1():
    # A: prompt 2, action 2, observation 1, action 1; reward 1.0 on its last action token (position 5).
    # B: prompt 1, action 3; reward 0.5 on position 3; positions 4-5 are padding.
    batch = to_tensors(
        [
            _trajectory("a", [5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 0, 1], 1.0),
            _trajectory("b", [5, 7, 8, 9], [0, 1, 1, 1], 0.5),
        ],
        pad_id=0,
    )
    nan = math.nan  # values off action tokens are never read
    values = torch.tensor([[nan, nan, 0.3, -0.2, nan, 0.7], [nan, 0.1, 0.4, 0.2, nan, nan]])
    # lam = gamma = 1: R_t = sum of the rewards from t on = the outcome reward; the values cancel (up to float32
    # rounding of A_t + V_t). Exactly 0 on the 6 other positions (A: 0, 1, 4; B: 0, 4, 5).
    targets = value_targets(batch, values, 1.0, 1.0)
    assert torch.allclose(targets, torch.tensor([[0, 0, 1.0, 1.0, 0, 1.0], [0, 0.5, 0.5, 0.5, 0, 0]]), atol=1e-6)
    assert torch.equal(targets[batch["action_mask"] == 0], torch.zeros(6))
    # lam = 0 bootstraps one action token ahead, skipping the observation: R_t = r_t + V(next(t)).
    # A: pos 2 -> V3 = -0.2; pos 3 -> V5 = 0.7 (skips position 4); pos 5 -> r = 1.  B: V2 = 0.4, V3 = 0.2, r = 0.5.
    assert torch.allclose(
        value_targets(batch, values, 1.0, 0.0), torch.tensor([[0, 0, -0.2, 0.7, 0, 1.0], [0, 0.4, 0.2, 0.5, 0, 0]])
    )


def test_split_keeps_each_prompt_on_one_side_and_ignores_finish_order():
    trajectories = [_trajectory(p, [5, 7], [0, 1], 1.0) for p in ("a", "b", "a", "c", "d", "b")]
    train, held = split_by_prompt(trajectories, 2, seed=0)
    assert len({t.prompt_id for t in held}) == 2 and len(train) + len(held) == 6
    assert not {t.prompt_id for t in train} & {t.prompt_id for t in held}
    again = split_by_prompt(list(reversed(trajectories)), 2, seed=0)
    assert [t.prompt_id for t in again[1]] == [t.prompt_id for t in held]
    with pytest.raises(ValueError, match="held_out"):
        split_by_prompt(trajectories, 4, seed=0)  # 4 prompts: nothing left to train on


def test_learner_starts_from_the_saved_critic(pretrained, sft_dir):
    cfg, result, _ = pretrained
    cfg = replace(cfg, train=replace(cfg.train, critic_path=str(result.out_dir)))
    learner = Learner(cfg, sft_dir, settings_from(cfg), threads=1)
    critic = learner.critic.module
    head = load_file(str(result.out_dir / HEAD_FILE))
    assert torch.equal(critic.value_head.weight, head["weight"]) and torch.equal(critic.value_head.bias, head["bias"])
    saved = ValueModel.load(result.out_dir).state_dict()
    assert all(torch.equal(tensor, saved[name]) for name, tensor in critic.state_dict().items())
    frozen = [n for n, p in critic.named_parameters() if not p.requires_grad]
    assert frozen and all(".self_attn." in n for n in frozen)  # sao freezes the loaded critic's attention


def test_learner_refuses_a_critic_that_does_not_fit(pretrained, sft_dir, sft_policy, tmp_path):
    cfg, _, _ = pretrained
    _, tokenizer = sft_policy
    narrow = build_policy(replace(cfg.model, hidden_size=64), tokenizer)
    ValueModel.from_policy(narrow).save(tmp_path / "narrow")
    cases = {
        str(tmp_path / "narrow"): (ValueError, r"train\.critic_path: .*hidden_size=64, the policy has hidden_size=128"),
        str(tmp_path / "missing"): (FileNotFoundError, r"train\.critic_path: .*not a directory"),
        str(sft_dir): (FileNotFoundError, rf"train\.critic_path: .*no {HEAD_FILE}"),
    }
    for path, (error, message) in cases.items():
        bad = replace(cfg, train=replace(cfg.train, critic_path=path))
        with pytest.raises(error, match=message):
            Learner(bad, sft_dir, settings_from(bad), threads=1)


def test_an_algorithm_without_a_critic_is_refused(tiny_cfg, sft_dir, tmp_path):
    cfg = replace(tiny_cfg, train=replace(tiny_cfg.train, algo="sao-running-mean"))
    with pytest.raises(ValueError, match="train.algo: 'sao-running-mean' trains no critic"):
        pretrain_value(cfg, sft_dir, tmp_path / "critic")
    assert not (tmp_path / "critic").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("value_pretrain.episodes=0", "value_pretrain.episodes: Input should be greater than 0"),
        ("value_pretrain.held_out_frac=1.0", "value_pretrain.held_out_frac: Input should be less than 1"),
        (
            "value_pretrain.episodes=10,value_pretrain.held_out_frac=0.04",  # round(10 * 0.04) = 0 held out
            r"value_pretrain.held_out_frac: holds out 0 of episodes=10",
        ),
        ("value_pretrain.lr=-1e-3", "value_pretrain.lr: Input should be greater than or equal to 0"),
        ("value_pretrain.patience=0", "value_pretrain.patience: Input should be greater than 0"),
        ("value_pretrain.batch_size=2.5", "value_pretrain.batch_size: Input should be a valid integer"),
        ("value_pretrain.epochs=3", "value_pretrain.epochs: unknown field"),
        ('train.critic_path="s3://bucket/critic"', "train.critic_path: must be a local directory"),
    ],
)
def test_bad_values_name_their_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-cpu", override.split(","))


def test_defaults_and_the_held_out_size():
    cfg = load_config("tiny-cpu")
    assert cfg.train.critic_path == "" and cfg.value_pretrain.lr == 0.0  # 0: train.critic_lr
    assert cfg.value_pretrain.held_out_episodes == 128  # round(512 * 0.25)
    assert (
        load_config(
            "tiny-cpu", ["value_pretrain.episodes=10", "value_pretrain.held_out_frac=0.5"]
        ).value_pretrain.held_out_episodes
        == 5
    )
