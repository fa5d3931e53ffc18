"""`train.deepspeed_config`: a DeepSpeed JSON file merged over the built-in config, on real CPU engines."""

import json
import math
from pathlib import Path

import pytest
import torch

from components.config import ConfigError, load_config
from components.training.engines.engine import DeepSpeedEngine
from components.training.engines.settings import EngineSettings

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, data: dict, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def _linear(weight: list[float]) -> torch.nn.Linear:
    layer = torch.nn.Linear(len(weight), 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([weight]))
    return layer


def test_file_wins_for_its_keys_and_the_sao_fields_keep_the_rest(tmp_path):
    """The file sets ZeRO-2, gradient_clipping 0.5 and Adam's eps 0.1; lr 2e-3 and betas (0.9, 0.9) come from
    the SAO fields. loss = w . x with x = [1, 1] gives g = [1, 1], |g| = sqrt(2). Clipping to 0.5 scales g by
    0.5 / sqrt(2): g' = [0.35355, 0.35355]. Adam's first step (bias-corrected m = g', sqrt(v) = |g'|) moves each
    weight by -lr * g' / (|g'| + eps) = -2e-3 * 0.35355 / 0.45355 = -1.55903e-3. (SAO's clip 1.0 would give
    -1.75221e-3, no clip -1.81818e-3, eps 1e-8 -2e-3.)"""
    path = _write(
        tmp_path, {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5, "optimizer": {"params": {"eps": 0.1}}}
    )
    engine = DeepSpeedEngine(
        _linear([1.0, -2.0]), EngineSettings(2e-3, grad_clip=1.0, zero_stage=0, beta2=0.9, deepspeed_config=path)
    )
    assert engine.zero_stage == 2 and engine.engine.zero_optimization_stage() == 2
    assert engine.engine.gradient_clipping() == 0.5
    group = engine.optimizer.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"]) == (2e-3, (0.9, 0.9), 0.1)

    norm = engine.backward_step(engine.module(torch.ones(1, 2)).sum())
    assert float(norm) == pytest.approx(math.sqrt(2), rel=1e-5)
    step = -2e-3 * (0.5 / math.sqrt(2)) / (0.5 / math.sqrt(2) + 0.1)
    assert engine.module.weight.detach()[0].tolist() == pytest.approx([1.0 + step, -2.0 + step], abs=1e-7)


def test_the_file_may_set_the_learning_rate_and_schedules_scale_it(tmp_path):
    """optimizer.params.lr in the file replaces the SAO field and is the base the schedule scales:
    0.25 x 4e-3 = 1e-3."""
    path = _write(tmp_path, {"optimizer": {"params": {"lr": 4e-3}}})
    engine = DeepSpeedEngine(_linear([1.0]), EngineSettings(2e-3, deepspeed_config=path))
    assert engine.base_lr == 4e-3
    engine.set_lr_scale(0.25)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_the_repository_zero2_bf16_file_builds_a_bf16_zero2_engine():
    engine = DeepSpeedEngine(
        _linear([1.0, 2.0]), EngineSettings(1e-3, deepspeed_config=str(REPO / "infra/deepspeed/zero2-bf16.json"))
    )
    assert engine.zero_stage == 2 and engine.module.weight.dtype == torch.bfloat16
    assert engine.base_lr == 1e-3 and engine.engine.gradient_clipping() == 1.0  # not in the file: SAO's


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"zero_optimization": {"stage": 4}},
            r"train\.deepspeed_config: .*ds\.json: zero_optimization\.stage: ZeRO stage 4 is not supported here \(0-3\)",
        ),
        ({"zero_optimization": {"stagee": 2}}, r"train\.deepspeed_config: .*zero_optimization\.stagee: Extra inputs"),
        ({"bf16": {"enabeld": True}}, r"train\.deepspeed_config: .*bf16\.enabeld: Extra inputs"),
        ({"zero_optimisation": {"stage": 2}}, r"zero_optimisation: unknown DeepSpeed key"),
        ({"gradient_accumulation_steps": 4}, r"gradient_accumulation_steps: must be 1 \(the learner .*\), got 4"),
        ({"scheduler": {"type": "WarmupLR"}}, r"scheduler: may not be set \(the learning-rate schedule is"),
        ({"fp16": {"enabled": True}}, r"fp16\.enabled: fp16 is not supported"),
    ],
)
def test_bad_files_are_refused_naming_the_field(tmp_path, data, message):
    with pytest.raises(ValueError, match=message):
        DeepSpeedEngine(_linear([1.0]), EngineSettings(1e-3, deepspeed_config=_write(tmp_path, data)))


def test_a_missing_or_broken_file_names_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train\.deepspeed_config: no such file .*nope\.json"):
        DeepSpeedEngine(_linear([1.0]), EngineSettings(1e-3, deepspeed_config=str(tmp_path / "nope.json")))
    (tmp_path / "bad.json").write_text("{stage: 2")
    with pytest.raises(ValueError, match=r"train\.deepspeed_config: .*bad\.json is not valid JSON"):
        DeepSpeedEngine(_linear([1.0]), EngineSettings(1e-3, deepspeed_config=str(tmp_path / "bad.json")))


def test_the_config_field_needs_the_deepspeed_backend():
    message = r"^train\.deepspeed_config: needs train\.backend = 'deepspeed', got 'torch'$"
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-cpu", ['train.backend="torch"', 'train.deepspeed_config="x.json"'])


def test_the_learner_passes_the_file_to_both_engines(tmp_path):
    """Policy and critic both get ZeRO-2 and the file's clip, each keeping its own learning rate."""
    from components.models import init_model_dir
    from components.training.rl.algorithms import settings_from
    from components.training.rl.learner import Learner

    path = _write(tmp_path, {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.25})
    cfg = load_config("tiny-cpu", [f'train.deepspeed_config="{path}"', "train.zero_stage=0"])
    model_dir = init_model_dir(cfg.model, tmp_path / "policy")
    learner = Learner(cfg, model_dir, settings_from(cfg), threads=1)
    for engine, lr in ((learner.policy, cfg.train.policy_lr), (learner.critic, cfg.train.critic_lr)):
        assert (engine.zero_stage, engine.engine.gradient_clipping(), engine.base_lr) == (2, 0.25, lr)


def test_one_rank_at_stage_0_skips_the_gradient_all_reduce_and_steps_the_same():
    """loss = w . x with x = [3, 4]: g = [3, 4], |g| = 5, clipped to 1.0: g' = [0.6, 0.8]. Adam's first step
    moves each weight by -lr * sign(g') (m / sqrt(v) = 1 up to eps): w = [1 - 1e-3, 2 - 1e-3]. ZeRO-2 keeps its
    reduction (it fills the optimizer's partitions) and takes the same step."""
    for stage, all_reduce in ((0, False), (2, True)):
        engine = DeepSpeedEngine(_linear([1.0, 2.0]), EngineSettings(1e-3, grad_clip=1.0, zero_stage=stage))
        assert engine.engine.enable_backward_allreduce is all_reduce
        norm = engine.backward_step(engine.module(torch.tensor([[3.0, 4.0]])).sum())
        assert float(norm) == pytest.approx(5.0, rel=1e-6)
        assert engine.module.weight.detach()[0].tolist() == pytest.approx([1.0 - 1e-3, 2.0 - 1e-3], abs=1e-7)


def test_skipping_the_one_rank_all_reduce_leaves_every_bit_of_the_updates():
    """Three steps of a small MLP with and without the all-reduce (forced back on): the same weights, bit for bit."""
    weights = []
    for all_reduce in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        engine = DeepSpeedEngine(model, EngineSettings(1e-2, grad_clip=0.5, zero_stage=0))
        engine.engine.enable_backward_allreduce = all_reduce
        for step in range(3):
            x = torch.linspace(-1, 1, 12).reshape(3, 4) * (step + 1)
            engine.backward_step((engine.module(x) ** 2).mean())
        weights.append([p.detach().clone() for p in engine.module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_train_adam_eps_is_the_rl_engines_adam_epsilon(backend):
    """`train.adam_eps` reaches RL's engines (SFT keeps 1e-8). loss = w . x with x = [1e-4, 1e-4] gives
    g = [1e-4, 1e-4] (below the clip); Adam's first step moves each weight by -lr * g / (|g| + eps):
    -2e-3 * 1e-4 / (1e-4 + 1e-4) = -1e-3 at eps 1e-4, where eps 1e-8 would give -2e-3 (a full lr step)."""
    from components.training.engines.loading import open_engine
    from components.training.engines.settings import EngineSettings

    cfg = load_config("tiny-cpu", [f'train.backend="{backend}"', "train.adam_eps=1e-4", "train.policy_lr=2e-3"])
    settings = EngineSettings.rl(cfg.train, cfg.train.policy_lr)
    assert EngineSettings.sft(cfg).eps == 1e-8
    engine = open_engine(settings, settings.deepspeed(), _linear([1.0, -2.0]))
    assert engine.optimizer.param_groups[0]["eps"] == 1e-4
    engine.backward_step(engine.module(torch.full((1, 2), 1e-4)).sum())
    assert engine.module.weight.detach()[0].tolist() == pytest.approx([1.0 - 1e-3, -2.0 - 1e-3], abs=1e-6)


def test_the_repository_zero3_bf16_file_trains_the_critic_in_the_backbones_dtype(tmp_path):
    """The GPU presets' file (ZeRO-3, bf16) with the critic loaded into partitions: DeepSpeed flattens one dtype,
    so a fp32 head beside the bf16 backbone failed `deepspeed.initialize` (issue 42). The head is bf16, the
    values fp32, and an update moves the head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from components.training.engines.loading import initial_critic, load_model, open_engine

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "policy")
    settings = EngineSettings(1e-2, "deepspeed", deepspeed_config=str(REPO / "infra/deepspeed/zero3-bf16.json"))
    ds_config = settings.deepspeed()
    critic = load_model(ds_config, lambda dtype: initial_critic(tmp_path / "policy", "", dtype))
    assert {p.dtype for p in critic.parameters()} == {torch.bfloat16}
    engine = open_engine(settings, ds_config, critic)
    assert engine.zero_stage == 3
    ids = torch.randint(0, 64, (2, 8))
    values = engine.module(ids)
    assert values.dtype == torch.float32 and values.shape == (2, 8)
    before = [part["value_head.bias"].clone() for part in engine.full_state() if "value_head.bias" in part]
    engine.backward_step((values - 1.0).pow(2).mean())
    after = [part["value_head.bias"] for part in engine.full_state() if "value_head.bias" in part]
    assert after[0].dtype == torch.bfloat16 and not torch.equal(before[0], after[0])


@pytest.mark.parametrize("chunk_size", [8, 80])
def test_zero3_gathers_the_lm_head_once_forward_and_once_backward_and_completes_its_trace(chunk_size):
    """The policy's log-prob path under ZeRO-3 (the GPU presets' file): the head's weight is gathered once per forward
    and once per backward whatever the number of chunks (80 action positions in chunks of 8 took 30 gathers: forward,
    recomputation and backward per chunk), DeepSpeed's step starts with each pass so its trace of module calls
    completes (it stayed invalid: the top module's forward never ran), and the log-probs and the head's gradient are
    plain torch's."""
    import copy

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from components.models.logprobs import token_logprobs
    from components.training.engines.loading import load_model, open_engine

    config = Qwen3MoeConfig(
        vocab_size=5000, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = Qwen3MoeForCausalLM(config)
    ids, actions = torch.randint(0, 5000, (2, 41)), torch.ones(2, 41, dtype=torch.bool)
    expected = token_logprobs(plain, ids, 1.0, chunk_size=chunk_size, positions=actions)
    expected.sum().backward()
    settings = EngineSettings(1e-2, "deepspeed", deepspeed_config=str(REPO / "infra/deepspeed/zero3-bf16.json"))
    ds_config = {**settings.deepspeed(), "bf16": {"enabled": False}}  # fp32: the same numbers as plain torch
    engine = open_engine(settings, ds_config, load_model(ds_config, lambda dtype: copy.deepcopy(plain).to(dtype)))
    coordinator = engine.engine.optimizer.parameter_offload.get_param_coordinator()
    fetch, head_fetches = coordinator.fetch_sub_module, []

    def counted(module, *args, **kwargs):  # DeepSpeed's own fetch, counted for the head
        head_fetches.append(module is engine.module.lm_head)
        return fetch(module, *args, **kwargs)

    coordinator.fetch_sub_module = counted
    from deepspeed.utils import safe_get_full_grad

    for step in range(2):
        head_fetches.clear()
        logprobs = token_logprobs(engine.module, ids, 1.0, chunk_size=chunk_size, positions=actions)
        engine.engine.backward(logprobs.sum())
        assert sum(head_fetches) == 2, (step, sum(head_fetches))
        torch.testing.assert_close(logprobs.detach(), expected.detach(), rtol=0, atol=1e-6)
        if step == 0:
            head_grad = safe_get_full_grad(engine.module.lm_head.weight)
            torch.testing.assert_close(head_grad, plain.lm_head.weight.grad, rtol=1e-5, atol=1e-7)
        engine.engine.optimizer.zero_grad()
    assert coordinator.is_complete_trace()
