"""How one engine trains: its optimizer's numbers and the hardware side (backend, ZeRO stage, DeepSpeed file,
activation checkpointing), in one record every engine and the DeepSpeed config read.

The hardware side of every engine is `train`'s; each stage brings its own learning rate and regularisation, and SFT
and value pretraining their own backend (`sft.backend`, `value_pretrain.backend`).
"""

from __future__ import annotations

from dataclasses import dataclass

from components.config import Config, TrainConfig
from components.training.engines.deepspeed_config import resolve_deepspeed_config


@dataclass(frozen=True)
class EngineSettings:
    lr: float
    backend: str = "torch"
    """torch (one process) or deepspeed."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    beta2: float = 0.95
    """AdamW's second beta (the first is 0.9)."""
    eps: float = 1e-8
    """AdamW epsilon (`train.adam_eps` for RL's engines)."""
    zero_stage: int = 0
    deepspeed_config: str = ""
    """A DeepSpeed JSON file merged over the built-in config ('' for none)."""
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"train.zero_stage: {self.zero_stage} is not supported here (0-3)")

    @classmethod
    def on_train_hardware(cls, tc: TrainConfig, backend: str, lr: float, **optimizer) -> EngineSettings:
        """A stage's own optimizer numbers (`optimizer`: weight_decay, grad_clip, beta2, eps) on `train`'s hardware."""
        return cls(
            lr,
            backend,
            zero_stage=tc.zero_stage,
            deepspeed_config=tc.deepspeed_config,
            activation_checkpointing=tc.activation_checkpointing,
            **optimizer,
        )

    @classmethod
    def rl(cls, tc: TrainConfig, lr: float, critic: bool = False) -> EngineSettings:
        """RL's policy (`lr` = train.policy_lr) or `critic` (train.critic_lr; its own clip, `critic_grad_clip`)."""
        return cls.on_train_hardware(
            tc,
            tc.backend,
            lr,
            weight_decay=tc.weight_decay,
            grad_clip=critic_grad_clip(tc) if critic else tc.grad_clip,
            beta2=tc.adam_beta2,
            eps=tc.adam_eps,
        )

    @classmethod
    def sft(cls, cfg: Config) -> EngineSettings:
        """SFT's policy (AdamW betas (0.9, 0.95))."""
        s = cfg.sft
        return cls.on_train_hardware(cfg.train, s.backend, s.lr, weight_decay=s.weight_decay, grad_clip=s.grad_clip)

    @classmethod
    def value_pretrain(cls, cfg: Config) -> EngineSettings:
        """Value pretraining's critic: training's optimizer settings at `value_pretrain.lr` (else train.critic_lr)."""
        tc, vp = cfg.train, cfg.value_pretrain
        return cls.on_train_hardware(
            tc,
            vp.backend,
            vp.lr or tc.critic_lr,
            weight_decay=tc.weight_decay,
            grad_clip=critic_grad_clip(tc),
            beta2=tc.adam_beta2,
        )

    def deepspeed(self) -> dict | None:
        """The DeepSpeed config the engine runs with (None for the torch backend); errors name the file."""
        if self.backend != "deepspeed":
            return None
        return resolve_deepspeed_config(self)


def critic_grad_clip(tc: TrainConfig) -> float:
    """The critic's gradient-norm clip: `train.critic_grad_clip`, else `train.grad_clip`."""
    return tc.grad_clip if tc.critic_grad_clip is None else tc.critic_grad_clip
