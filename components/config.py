"""The one typed configuration tree.

Frozen dataclasses, a docstring under every field, invariants checked at construction. Presets are data:
`components/presets/<name>.toml`, loaded by `load_config`, with optional dotted overrides
(`sft.steps=100`). Unknown keys and bad values fail with the dotted path of the field.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names the dotted field path."""


def _require(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{path}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None
    """Local Hugging Face model directory to start from; when set, the architecture fields below are ignored.
    Nothing is ever downloaded from a hub."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 3
    """Decoder layers."""
    num_heads: int = 2
    """Attention query heads."""
    num_kv_heads: int = 1
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int = 64
    """Per-head width; >= 64 so that vLLM's CPU attention accepts the model."""
    num_experts: int = 4
    """MoE experts per layer."""
    experts_per_token: int = 2
    """Experts routed per token (top-k)."""
    moe_intermediate_size: int = 128
    """Hidden width of each expert's MLP."""
    max_position_embeddings: int = 512
    """Context length in tokens."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                     "experts_per_token", "moe_intermediate_size", "max_position_embeddings"):
            _require(getattr(self, name) > 0, f"model.{name}", f"must be > 0, got {getattr(self, name)}")
        _require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
                 f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
        _require(self.experts_per_token <= self.num_experts, "model.experts_per_token",
                 f"must be <= num_experts={self.num_experts}, got {self.experts_per_token}")


@dataclass(frozen=True)
class TaskConfig:
    kinds: tuple[Literal["affine", "two_step"], ...] = ("affine",)
    """Problem families of the synthetic tool-integrated task: `affine` is a*b+c with one tool call,
    `two_step` is (a*b+c)*d solved with two tool calls."""
    operand_max: int = 99
    """Operands are drawn uniformly from [2, operand_max]."""
    train_size: int = 20000
    """Teacher traces generated for SFT."""
    eval_size: int = 200
    """Held-out problems (disjoint seed stream from training)."""
    seed: int = 0
    """Seed of the problem generator."""
    teacher_mental_max: int = 700
    """The teacher answers without a tool call when a*b < this (a strong model's mental arithmetic, which
    the tiny student cannot imitate; the gap RL closes). 0: always use the tool."""
    max_turns: int = 4
    """Model turns per episode (each turn ends at a tool call or the final answer)."""
    max_new_tokens: int = 48
    """New tokens per model turn."""

    def __post_init__(self) -> None:
        _require(len(self.kinds) > 0, "task.kinds", "must name at least one problem family")
        for kind in self.kinds:
            _require(kind in ("affine", "two_step"), "task.kinds", f"unknown problem family {kind!r}")
        _require(self.operand_max >= 2, "task.operand_max", f"must be >= 2, got {self.operand_max}")
        _require(self.teacher_mental_max >= 0, "task.teacher_mental_max",
                 f"must be >= 0, got {self.teacher_mental_max}")
        for name in ("train_size", "eval_size", "max_turns", "max_new_tokens"):
            _require(getattr(self, name) > 0, f"task.{name}", f"must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 64
    """Traces per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to min_lr)."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 50
    """Linear warm-up steps (capped at `steps`)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    seed: int = 0
    """Seed for model init and batch order."""
    log_every: int = 100
    """Steps between progress lines."""

    def __post_init__(self) -> None:
        _require(self.steps > 0, "sft.steps", f"must be > 0, got {self.steps}")
        _require(self.batch_size > 0, "sft.batch_size", f"must be > 0, got {self.batch_size}")
        _require(0 < self.min_lr <= self.lr, "sft.min_lr", f"must be in (0, lr={self.lr}], got {self.min_lr}")
        _require(self.warmup_steps >= 0, "sft.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(self.grad_clip > 0, "sft.grad_clip", f"must be > 0, got {self.grad_clip}")
        _require(self.log_every > 0, "sft.log_every", f"must be > 0, got {self.log_every}")


@dataclass(frozen=True)
class AlgoConfig:
    gamma: float = 1.0
    """Discount."""
    lam_critic: float = 1.0
    """GAE lambda for the critic's targets (DESIGN: decoupled lambdas)."""
    lam_policy: float = 0.95
    """GAE lambda for the policy's advantages."""
    dis_preset: Literal["reasoning", "coding"] = "reasoning"
    """DIS window preset: reasoning (0.3, 5.0), coding (0.8, 3.0); eps_low/eps_high override it."""
    eps_low: float | None = None
    """DIS lower half-width; None takes the preset's."""
    eps_high: float | None = None
    """DIS upper half-width; None takes the preset's."""
    temperature: float = 1.0
    """Rollout sampling temperature; log-probs are log_softmax(logits / temperature)."""
    critic_updates: int = 2
    """K: critic updates per policy update."""
    value_clip: float = 0.2
    """Clip range of the value loss."""
    normalize_advantages: bool = False
    """Whiten advantages per mini-batch (off for SAO)."""

    def __post_init__(self) -> None:
        for name in ("gamma", "lam_critic", "lam_policy"):
            value = getattr(self, name)
            _require(0.0 <= value <= 1.0, f"algo.{name}", f"must be in [0, 1], got {value}")
        _require(self.dis_preset in ("reasoning", "coding"), "algo.dis_preset",
                 f"must be 'reasoning' or 'coding', got {self.dis_preset!r}")
        for name in ("eps_low", "eps_high"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"algo.{name}", f"must be > 0, got {value}")
        _require(self.temperature > 0, "algo.temperature", f"must be > 0, got {self.temperature}")
        _require(self.critic_updates >= 1, "algo.critic_updates", f"must be >= 1, got {self.critic_updates}")
        _require(self.value_clip > 0, "algo.value_clip", f"must be > 0, got {self.value_clip}")

    @property
    def dis_window(self) -> tuple[float, float]:
        """(eps_low, eps_high) after applying the preset."""
        from components.algo import DIS_PRESETS

        low, high = DIS_PRESETS[self.dis_preset]
        return (self.eps_low if self.eps_low is not None else low,
                self.eps_high if self.eps_high is not None else high)


@dataclass(frozen=True)
class RolloutConfig:
    concurrency: int = 8
    """Episodes in flight at once (C)."""
    max_total_tokens: int = 512
    """Tokens per episode: prompt + actions + observations."""
    max_wall_s: float = 120.0
    """Wall-clock limit per episode."""
    tool_timeout_s: float = 5.0
    """Sandbox time limit per tool call."""
    latency: Literal["none", "fixed", "lognormal"] = "none"
    """Simulated extra tool latency (benchmarks): none, fixed or lognormal (heavy tail)."""
    latency_mean_s: float = 0.0
    """Mean of the simulated tool latency."""
    latency_sigma: float = 1.5
    """Lognormal sigma of the simulated tool latency."""
    max_batch: int = 64
    """Sequences the embedded engine decodes together at most."""
    engine_threads: int = 0
    """torch CPU threads of the embedded engine. 0: half the cores in async mode (the trainer gets the rest;
    sharing cores between OpenMP teams stalls both), all of them in sync mode."""

    def __post_init__(self) -> None:
        _require(self.engine_threads >= 0, "rollout.engine_threads", f"must be >= 0, got {self.engine_threads}")
        for name in ("concurrency", "max_total_tokens", "max_batch"):
            _require(getattr(self, name) >= 1, f"rollout.{name}", f"must be >= 1, got {getattr(self, name)}")
        for name in ("max_wall_s", "tool_timeout_s"):
            _require(getattr(self, name) > 0, f"rollout.{name}", f"must be > 0, got {getattr(self, name)}")
        _require(self.latency in ("none", "fixed", "lognormal"), "rollout.latency",
                 f"must be none, fixed or lognormal, got {self.latency!r}")
        _require(self.latency_mean_s >= 0 and self.latency_sigma >= 0, "rollout.latency_mean_s",
                 "latency_mean_s and latency_sigma must be >= 0")


@dataclass(frozen=True)
class TrainConfig:
    algo: Literal["sao", "sao-k1", "sao-full-critic", "sao-running-mean", "grpo", "grpo-dis", "ppo"] = "sao"
    """Algorithm (one loop for all; see components/training/algorithms.py)."""
    batch_size: int = 16
    """Trajectories per policy update (whole groups for GRPO)."""
    max_steps: int = 200
    """Policy updates."""
    max_staleness: int = 2
    """Admission control bound, in policy versions (see `admission`)."""
    admission: Literal["capacity", "oldest"] = "capacity"
    """capacity: at most (version + max_staleness + 1) x batch_size episodes ever started (AReaL); oldest: no
    new episode while the oldest in-flight one started more than max_staleness versions ago (one straggler
    stalls every start). See components/training/buffer.py."""
    sync: bool = False
    """Synchronous mode: generate a batch, wait for all of it, train (same code, for async-vs-sync)."""
    sync_lag: int = 0
    """Synchronous mode only: roll out with the policy this many versions old, a reproducible stand-in for
    asynchronous policy lag (the learning-curve regression test uses it). Not carried across a resume."""
    group_size: int = 8
    """GRPO group size N (grpo, grpo-dis)."""
    policy_lr: float = 3e-4
    """Policy AdamW learning rate (tiny-cpu: 1e-4 barely moved in 100 steps, 2e-3 collapsed)."""
    critic_lr: float = 1e-3
    """Critic AdamW learning rate (larger than the policy's, DESIGN)."""
    weight_decay: float = 0.0
    """AdamW weight decay for both models."""
    adam_beta2: float = 0.95
    """AdamW second-moment decay for both models (tiny-cpu: 0.999 collapsed 2 of 3 runs, 0.95 1 of 5)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip for both models."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up of both models over the first steps (0: none)."""
    min_lr_ratio: float = 1.0
    """Cosine decay of both learning rates to this fraction of their peak at `max_steps` (1.0: constant)."""
    collapse_guard: Literal["rollback", "stop", "off"] = "rollback"
    """When the collapse rule fires (components/training/stability.py): roll back to the newest checkpoint
    before the collapse and continue with the learning rates scaled by `rollback_lr_scale` (rollback), roll
    back and end the run there (stop), or only log it (off)."""
    rollback_lr_scale: float = 0.5
    """Factor on both learning rates after each rollback."""
    max_rollbacks: int = 2
    """Rollbacks allowed before the guard stops the run instead."""
    backend: Literal["torch", "deepspeed"] = "deepspeed"
    """Training engine: DeepSpeed (ZeRO, CPU fp32 / GPU bf16) or plain torch AdamW."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (0-2)."""
    checkpoint_every: int = 10
    """Steps between checkpoints (0: only at the end)."""
    task_seed: int = 1
    """Seed of the RL prompt stream (disjoint from SFT's and from the held-out set)."""
    threads: int = 0
    """torch CPU threads of the trainer. 0: the cores the engine does not use in async mode, all in sync mode."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_steps", "group_size"):
            _require(getattr(self, name) >= 1, f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        _require(self.admission in ("capacity", "oldest"), "train.admission",
                 f"must be capacity or oldest, got {self.admission!r}")
        _require(0 < self.adam_beta2 < 1, "train.adam_beta2", f"must be in (0, 1), got {self.adam_beta2}")
        _require(self.sync_lag >= 0, "train.sync_lag", f"must be >= 0, got {self.sync_lag}")
        _require(self.sync or not self.sync_lag, "train.sync_lag", "needs train.sync = true (async runs lag anyway)")
        _require(self.threads >= 0, "train.threads", f"must be >= 0, got {self.threads}")
        _require(self.max_staleness >= 0, "train.max_staleness", f"must be >= 0, got {self.max_staleness}")
        _require(self.policy_lr > 0 and self.critic_lr > 0, "train.policy_lr", "learning rates must be > 0")
        _require(self.zero_stage in (0, 1, 2), "train.zero_stage", f"must be 0, 1 or 2, got {self.zero_stage}")
        _require(self.checkpoint_every >= 0, "train.checkpoint_every", f"must be >= 0, got {self.checkpoint_every}")
        _require(self.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(0 < self.min_lr_ratio <= 1, "train.min_lr_ratio", f"must be in (0, 1], got {self.min_lr_ratio}")
        _require(self.collapse_guard in ("rollback", "stop", "off"), "train.collapse_guard",
                 f"must be rollback, stop or off, got {self.collapse_guard!r}")
        _require(0 < self.rollback_lr_scale <= 1, "train.rollback_lr_scale",
                 f"must be in (0, 1], got {self.rollback_lr_scale}")
        _require(self.max_rollbacks >= 0, "train.max_rollbacks", f"must be >= 0, got {self.max_rollbacks}")
        if self.algo in ("grpo", "grpo-dis"):
            _require(self.batch_size % self.group_size == 0, "train.batch_size",
                     f"must be a multiple of group_size={self.group_size} for {self.algo}, got {self.batch_size}")


@dataclass(frozen=True)
class TrackingConfig:
    backend: Literal["mlflow", "disk"] = "mlflow"
    """Where metrics go besides the JSON lines under the home: MLflow, or the JSON lines only."""
    uri: str = ""
    """MLflow tracking URI. Empty: `$MLFLOW_TRACKING_URI` if set, else `sqlite:///<home>/mlflow.db`."""
    experiment: str = "sao"
    """MLflow experiment name."""

    def __post_init__(self) -> None:
        _require(self.backend in ("mlflow", "disk"), "tracking.backend",
                 f"must be mlflow or disk, got {self.backend!r}")
        _require(bool(self.experiment.strip()), "tracking.experiment", "must not be empty")


@dataclass(frozen=True)
class Config:
    name: str = "custom"
    """Preset or run name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy architecture (the critic shares it)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The synthetic tool-integrated task."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning on teacher traces."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """SAO math settings."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Agent runner and embedded engine."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The asynchronous RL trainer."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Metric tracking (MLflow)."""


def load_config(preset: str, overrides: list[str] | None = None) -> Config:
    """Load `presets/<preset>.toml` and apply `key.path=value` overrides (values parsed as TOML)."""
    path = PRESET_DIR / f"{preset}.toml"
    if not path.exists():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.toml"))
        raise ConfigError(f"preset: unknown preset {preset!r}; known presets: {known}")
    data = tomllib.loads(path.read_text())
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare string such as a path
        node = data
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    data.setdefault("name", preset)
    return from_dict(Config, data)


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build a (nested) config dataclass from plain data, rejecting unknown keys by their dotted path."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown field (expected one of {sorted(names)})")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{key}: expected a table, got {value!r}")
            kwargs[key] = from_dict(hint, value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, hint, f"{prefix}{key}")
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config (for logging and for saving next to checkpoints)."""
    return dataclasses.asdict(config)


def _coerce(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return tuple(_coerce(v, args[0], path) for v in value)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: must be one of {list(args)}, got {value!r}")
        return value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{path}: expected {hint.__name__}, got {value!r}")
    return value
