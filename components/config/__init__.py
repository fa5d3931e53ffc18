"""The one typed configuration tree: `Config` and `load_config` here, its tables in `sections.py`, the shared
building blocks and named choices in `fields.py`.

Frozen pydantic dataclasses (real dataclasses: `dataclasses.replace` and `asdict` work), a docstring under
every field, types checked strictly and invariants checked at construction. Presets are data:
`components/presets/<name>.toml`, loaded by `load_config`, with optional dotted overrides (`sft.steps=100`,
`'rollout.urls=["http://h:8000"]'`). Every bad key or value raises `ConfigError` naming the dotted field path.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, ValidationInfo

from components.config.fields import (
    STYLES,
    AdmissionRule,
    AlgoName,
    ConfigError,
    LatencyKind,
    RollbackTo,
    Style,
    T,
    section,
)
from components.config.sections import (
    AlgoConfig,
    DistillConfig,
    EnvConfig,
    ModelConfig,
    RolloutConfig,
    SFTConfig,
    StoreConfig,
    TaskConfig,
    TrackingConfig,
    TrainConfig,
    ValuePretrainConfig,
)

PRESET_DIR = Path(__file__).parents[1] / "presets"

__all__ = [
    "STYLES",
    "AdmissionRule",
    "AlgoConfig",
    "AlgoName",
    "Config",
    "ConfigError",
    "DistillConfig",
    "EnvConfig",
    "LatencyKind",
    "ModelConfig",
    "RollbackTo",
    "RolloutConfig",
    "SFTConfig",
    "StoreConfig",
    "Style",
    "TaskConfig",
    "TrackingConfig",
    "TrainConfig",
    "ValuePretrainConfig",
    "load_config",
    "to_dict",
]


def _table(value: Any, info: ValidationInfo) -> Any:
    """A `Config` section given as a dict (a TOML table) is built as its dataclass (strict pydantic
    dataclasses take only instances); errors come back as `ConfigError`s with their dotted paths."""
    if isinstance(value, dict):
        return typing.get_type_hints(Config)[info.field_name](**value)
    if not dataclasses.is_dataclass(value):
        raise ConfigError(f"{info.field_name}: expected a table, got {value!r}")
    return value


Table = Annotated[T, BeforeValidator(_table)]


@section("")
class Config:
    name: str = "custom"
    """Preset or run name."""
    model: Table[ModelConfig] = field(default_factory=ModelConfig)
    """Policy architecture (the critic shares it)."""
    task: Table[TaskConfig] = field(default_factory=TaskConfig)
    """The synthetic tool-integrated task."""
    sft: Table[SFTConfig] = field(default_factory=SFTConfig)
    """Supervised fine-tuning on teacher traces."""
    algo: Table[AlgoConfig] = field(default_factory=AlgoConfig)
    """SAO math settings."""
    rollout: Table[RolloutConfig] = field(default_factory=RolloutConfig)
    """Agent runner and embedded engine."""
    train: Table[TrainConfig] = field(default_factory=TrainConfig)
    """The asynchronous RL trainer."""
    tracking: Table[TrackingConfig] = field(default_factory=TrackingConfig)
    """Metric tracking (MLflow)."""
    env: Table[EnvConfig] = field(default_factory=EnvConfig)
    """The environment and its problem sets."""
    store: Table[StoreConfig] = field(default_factory=StoreConfig)
    """Where artifacts are kept."""
    distill: Table[DistillConfig] = field(default_factory=DistillConfig)
    """The teacher that writes SFT traces."""
    value_pretrain: Table[ValuePretrainConfig] = field(default_factory=ValuePretrainConfig)
    """Critic pretraining on rollouts of the SFT policy, before RL."""


def load_config(preset: str, overrides: list[str] | None = None) -> Config:
    """Load `presets/<preset>.toml` and apply `key.path=value` overrides (values parsed as TOML, else taken
    as a bare string such as a path)."""
    path = PRESET_DIR / f"{preset}.toml"
    if not path.exists():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.toml"))
        raise ConfigError(f"preset: unknown preset {preset!r}; known presets: {known}")
    data = apply_overrides(tomllib.loads(path.read_text()), overrides)
    data.setdefault("name", preset)
    return Config(**data)


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """`data` (a config's nested dict, changed in place) with `key.path=value` overrides applied."""
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = data
        *parents, leaf = key.strip().split(".")
        if not all(part.strip() for part in [*parents, leaf]):
            raise ConfigError(f"override {item!r}: empty part in key {key.strip()!r}; expected key.path=value")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(parents[: i + 1])}: not a table, cannot set {key.strip()}")
        node[leaf] = value
    return data


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config (for logging and for saving next to checkpoints); `Config(**d)` (or the
    section's class) builds it back."""
    return dataclasses.asdict(config)
