"""NaN and Inf injected into rewards, critic values, rollout log-probs and gradients: the update is skipped on
every backend and ZeRO stage (weights and optimizer state bit-identical), counted (`skipped_steps`,
`trainer/skipped_steps`), and the next clean step is exactly the step a run without the fault would take.

Models are the tiny preset's architecture at random init (the step's arithmetic, not what the policy learned,
is under test), also for the trainer-level test, which runs the real loop.
"""

import copy
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from components.config import load_config
from components.models import ValueModel, build_policy, build_tokenizer, freeze_attention, token_logprobs
from components.training.engines.engine import DeepSpeedEngine, TorchEngine
from components.training.engines.settings import EngineSettings
from components.training.rl.algorithms import ALGORITHMS
from components.training.rl.step import train_step
from tests.conftest import child_env
from tests.training.test_algorithms import SETTINGS as ALGORITHM_SETTINGS

BACKENDS = {
    "torch": lambda module, lr: TorchEngine(module, EngineSettings(lr)),
    "zero0": lambda module, lr: DeepSpeedEngine(module, EngineSettings(lr, zero_stage=0)),
    "zero1": lambda module, lr: DeepSpeedEngine(module, EngineSettings(lr, zero_stage=1)),
    "zero2": lambda module, lr: DeepSpeedEngine(module, EngineSettings(lr, zero_stage=2)),
}
K = 2
SETTINGS = replace(ALGORITHM_SETTINGS, critic_updates=K, group_size=2)
WORKER = Path(__file__).with_name("numerical_faults_worker.py")


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these models are tiny, and on shared cores more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy_model():
    return build_policy(load_config("tiny-cpu").model, build_tokenizer(), seed=0)


def make_batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """4 rows of 16 tokens: prompt 0-3, actions 4-8, an observation 9-10, actions 11-15 (row 3 padded after 12).
    Rollout log-probs are the model's own plus noise well inside the DIS window; rewards 1, 0, 1, 0 on each
    row's last action token."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (4, 16), generator=gen)
    att = torch.ones(4, 16, dtype=torch.long)
    att[3, 13:] = 0
    act = torch.zeros(4, 16)
    act[:, 4:9] = 1
    act[:, 11:16] = 1
    act[3, 13:] = 0
    with torch.no_grad():
        own = token_logprobs(model, ids, 1.0, att)
    rollout = torch.where(act.bool(), own + 0.05 * torch.randn(4, 16, generator=gen), torch.zeros(()))
    rewards = torch.zeros(4, 16)
    rewards[torch.arange(4), torch.tensor([15, 15, 15, 12])] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    return {
        "input_ids": ids,
        "attention_mask": att,
        "action_mask": act,
        "rollout_logprobs": rollout,
        "versions": torch.zeros(4, 16, dtype=torch.long),
        "rewards": rewards,
    }


def engines(backend: str, policy_model: torch.nn.Module, critic: bool = True):
    """(policy, critic) engines on fresh copies of the same starting weights (the critic: SAO's, attention
    frozen); equal calls give equal engines, so a reference run starts where the faulted one did."""
    make = BACKENDS[backend]
    policy = make(copy.deepcopy(policy_model), 1e-3)
    if not critic:
        return policy, None
    torch.manual_seed(1)  # the fresh value head's initialisation
    value_model = ValueModel.from_policy(policy_model)
    freeze_attention(value_model)
    return policy, make(value_model, 1e-2)


def weights(*engines) -> list[torch.Tensor]:
    return [p.detach().clone() for e in engines if e is not None for p in e.module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class OneShot:
    """A gradient hook on `param` that replaces its next gradient with `value` (NaN or Inf), once."""

    def __init__(self, param: torch.nn.Parameter, value: float) -> None:
        self.handle = param.register_hook(self)
        self.value = value

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        self.handle.remove()
        return torch.full_like(grad, self.value)


def corrupt_values(critic, value: float):
    """Every critic forward returns `value` at one action position until the handle is removed."""

    def hook(module, inputs, out):
        out = out.clone()
        out[0, 6] = value
        return out

    return critic.module.register_forward_hook(hook)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_non_finite_gradients_skip_the_update_and_leave_no_trace(backend, policy_model):
    """A NaN, then an Inf, gradient on one parameter: both updates skipped (weights bit-identical), counted, and
    the clean step after them is bit-for-bit the step of an engine that never saw them (DeepSpeed's partitioned
    gradient buffers and Adam's state were left clean)."""
    batch = make_batch(policy_model)

    def loss(engine):
        return -token_logprobs(engine.module, batch["input_ids"], 1.0, batch["attention_mask"]).mean()

    engine, _ = engines(backend, policy_model, critic=False)
    start = weights(engine)
    param = next(p for p in engine.module.parameters() if p.requires_grad)
    for value in (math.nan, math.inf):
        OneShot(param, value)
        norm = engine.backward_step(loss(engine))
        assert not math.isfinite(norm) and same(weights(engine), start), value
    assert engine.skipped_steps == 2
    norm = engine.backward_step(loss(engine))
    assert math.isfinite(norm) and norm > 0 and engine.skipped_steps == 2

    reference, _ = engines(backend, policy_model, critic=False)
    assert reference.backward_step(loss(reference)) == norm
    moved = weights(engine)
    assert not same(moved, start) and all(torch.isfinite(w).all() for w in moved)
    assert same(moved, weights(reference))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_config_file_cannot_turn_the_zero_guard_off(stage, policy_model, tmp_path):
    """bf16 ZeRO-1/2 with `bf16.check_grad_overflow: false` in the file: DeepSpeed alone would apply the NaN
    gradient (the weights turn NaN); the engine keeps the optimizer's check on, so the update is skipped."""
    config = tmp_path / "ds.json"
    config.write_text('{"bf16": {"enabled": true, "check_grad_overflow": false}}')
    engine = DeepSpeedEngine(
        copy.deepcopy(policy_model), EngineSettings(1e-3, zero_stage=stage, deepspeed_config=str(config))
    )
    start = weights(engine)
    OneShot(next(p for p in engine.module.parameters() if p.requires_grad), math.nan)
    ids = make_batch(policy_model)["input_ids"]
    norm = engine.backward_step(-token_logprobs(engine.module, ids).float().mean())
    assert math.isnan(norm) and engine.skipped_steps == 1 and same(weights(engine), start)


def _nan_reward(batch):
    batch["rewards"][1, 15] = math.nan


def _inf_reward(batch):
    batch["rewards"][2, 15] = math.inf


def _nan_rollout_logprob(batch):  # DIS's window test is false for a NaN ratio: this token was silently masked
    batch["rollout_logprobs"][0, 5] = math.nan


def _inf_rollout_logprob(batch):  # ratio exp(+inf) is outside the window: masked, the loss stayed finite
    batch["rollout_logprobs"][3, 12] = -math.inf


INPUT_FAULTS = [_nan_reward, _inf_reward, _nan_rollout_logprob, _inf_rollout_logprob]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_non_finite_inputs_skip_the_sao_step(backend, policy_model):
    """Each fault skips the whole SAO step: K critic updates and the policy update, all counted, no weight
    moved; a NaN/Inf critic value skips the critic's K updates and (through the advantages) the policy update.
    Then a clean step equals a fault-free run's first step exactly."""
    clean = make_batch(policy_model)
    policy, critic = engines(backend, policy_model)
    start = weights(policy, critic)
    for n, fault in enumerate(INPUT_FAULTS, 1):
        batch = {k: v.clone() for k, v in clean.items()}
        fault(batch)
        metrics = train_step(policy, critic, batch, SETTINGS, {})
        assert same(weights(policy, critic), start), fault.__name__
        assert (policy.skipped_steps, critic.skipped_steps) == (n, K * n), fault.__name__
        assert math.isnan(metrics["policy/grad_norm"]) and math.isnan(metrics["critic/grad_norm"])
    for value in (math.nan, math.inf):
        handle = corrupt_values(critic, value)
        train_step(policy, critic, clean, SETTINGS, {})
        handle.remove()
        assert same(weights(policy, critic), start), value
    assert (policy.skipped_steps, critic.skipped_steps) == (6, 6 * K)

    metrics = train_step(policy, critic, clean, SETTINGS, {})
    assert (policy.skipped_steps, critic.skipped_steps) == (6, 6 * K)
    assert all(math.isfinite(v) for k, v in metrics.items() if k.endswith("grad_norm") or k.endswith("loss"))
    ref_policy, ref_critic = engines(backend, policy_model)
    ref_metrics = train_step(ref_policy, ref_critic, clean, SETTINGS, {})
    assert metrics.keys() == ref_metrics.keys()
    assert all(torch.equal(torch.as_tensor(metrics[k]), torch.as_tensor(ref_metrics[k])) for k in metrics)
    assert not same(weights(policy, critic), start)
    assert same(weights(policy, critic), weights(ref_policy, ref_critic))


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_skips_a_batch_with_a_non_finite_reward_or_log_prob(name, policy_model):
    """The guard sits in front of every step: the running-mean baseline never sees a NaN reward (it would poison
    its window), and PPO, which clamps an infinite log-ratio to a finite one, never trains on it."""
    algorithm = ALGORITHMS[name]
    settings = replace(
        SETTINGS, critic_updates=algorithm.critic_updates or K, advantage=algorithm.advantage, loss=algorithm.loss
    )
    policy, critic = engines("torch", policy_model, critic=algorithm.uses_critic)
    start, state = weights(policy, critic), {}
    for n, fault in enumerate((_nan_reward, _inf_rollout_logprob), 1):
        batch = make_batch(policy_model)
        fault(batch)
        train_step(policy, critic, batch, settings, state)
        assert same(weights(policy, critic), start)
        assert policy.skipped_steps == n and (critic is None or critic.skipped_steps == n * settings.critic_updates)
    assert all(b.value == 0.0 for b in state.values())  # the running mean saw no reward (NaN, or 0.5 if it had)
    train_step(policy, critic, make_batch(policy_model), settings, state)
    assert not same(weights(policy, critic), start) and policy.skipped_steps == 2


def test_skipped_steps_travel_with_the_engine_state(policy_model):
    """The count is part of a checkpoint: a restored engine goes on counting from it."""
    engine, _ = engines("torch", policy_model, critic=False)
    engine.skip_update()
    restored, _ = engines("torch", policy_model, critic=False)
    restored.load_state_dict(engine.state_dict())
    assert restored.skipped_steps == 1


def test_two_ranks_skip_together_when_only_one_sees_the_fault(tmp_path):
    """Under torchrun with 2 ranks, only rank 1 gets a NaN gradient (ZeRO 0, 1, 2), or a NaN reward in its rows
    (SAO step, ZeRO-2): both ranks skip, their weights stay bit-identical to before and to each other, and the
    next clean step moves both to the same weights."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()))
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(WORKER), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for case in ("zero0", "zero1", "zero2", "sao-zero2"):
        a, b = ranks[0][case], ranks[1][case]
        assert a["skipped"] == b["skipped"] == a["expected_skipped"], case
        assert a["unchanged"] and b["unchanged"], case  # the skipped update left every rank's weights alone
        assert a["moved"] and b["moved"], case  # and the clean one moved them
        assert torch.equal(a["after"], b["after"]), case  # to the same weights on both ranks


def test_a_run_with_a_fault_at_one_step_completes_and_logs_the_skip(tmp_path, policy_model, monkeypatch):
    """A 3-step SAO run whose second batch carries a NaN reward: all 3 steps run, trainer/skipped_steps reads
    0, 1, 1 (critic: 0, K, K), and the checkpoint carries the count."""
    from components.envs.registry import build_env
    from components.models import save_model_dir
    from components.tracking import DiskTracker
    from components.training.rl import trainer

    start_dir = save_model_dir(policy_model, build_tokenizer(), tmp_path / "start")  # what the run starts from
    real_to_tensors, batches = trainer.to_tensors, []

    def to_tensors(batch, pad_id):  # the trainer's own, with a NaN outcome reward in the second batch
        tensors = real_to_tensors(batch, pad_id)
        batches.append(tensors)
        if len(batches) == 2:
            tensors["rewards"][0, tensors["action_mask"][0].nonzero().max()] = math.nan
        return tensors

    monkeypatch.setattr(trainer, "to_tensors", to_tensors)
    base = load_config("tiny-cpu")
    cfg = replace(
        base,
        train=replace(base.train, backend="torch", batch_size=4, max_steps=3, sync=True, checkpoint_every=1, threads=1),
        rollout=replace(base.rollout, concurrency=4, engine_threads=1),
    )
    k = cfg.algo.critic_updates
    result = trainer.train(
        cfg, build_env(cfg), start_dir, tmp_path, DiskTracker(tmp_path / "m.jsonl"), log=lambda _: None
    )
    assert result.version == 3 and len(result.history) == 3
    assert [r["trainer/skipped_steps"] for r in result.history] == [0, 1, 1]
    assert [r["trainer/critic_skipped_steps"] for r in result.history] == [0, k, k]
    assert math.isnan(result.history[1]["policy/grad_norm"]) and math.isfinite(result.history[2]["policy/loss"])
    logged = [
        r["metrics"] for r in DiskTracker.read(tmp_path / "m.jsonl") if "trainer/skipped_steps" in r.get("metrics", {})
    ]
    assert [m["trainer/skipped_steps"] for m in logged] == [0, 1, 1]
    saved = tmp_path / "checkpoints" / cfg.name / "step-00000003"
    assert torch.load(saved / "policy" / "engine.pt", weights_only=False)["skipped_steps"] == 1
    assert torch.load(saved / "critic" / "engine.pt", weights_only=False)["skipped_steps"] == k
