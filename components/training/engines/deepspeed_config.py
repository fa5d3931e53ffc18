"""DeepSpeed's configuration for the training engines: the built-in config the SAO fields give, a
`train.deepspeed_config` file merged over it, and the checks that refuse what the learner cannot honour.

A DeepSpeed JSON file (`train.deepspeed_config`, e.g. `infra/deepspeed/zero3-bf16.json`) is merged over the built-in
config, the file winning key by key (`merge_deepspeed_config`). The learner owns the batch shape (one optimizer
step per `apply`, its micro-batches accumulated through DeepSpeed's own gradient-accumulation boundary) and the
learning-rate schedule, so a file may not set those. `deepspeed_schema_problems` runs DeepSpeed's own validation,
so a misspelt key is refused rather than silently ignored. `tools.infra_check` runs the same checks on the
repository's files.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import KeysView
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic
import torch

if TYPE_CHECKING:
    from components.training.engines.settings import EngineSettings


def default_accelerator() -> None:
    """`DS_ACCELERATOR` for DeepSpeed, unless set: cuda when torch sees a GPU, else cpu. Before importing it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")


ONE_STEP_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""DeepSpeed keys that must stay 1: the learner takes one optimizer step per `apply`, and sets DeepSpeed's
gradient-accumulation boundary itself for its micro-batches (`train.micro_batch_tokens`)."""
SAO_OWNED_KEYS = {
    "train_batch_size": "train.batch_size sets the batch; the learner takes one optimizer step per batch",
    "scheduler": "the learning-rate schedule is train.warmup_steps / train.min_lr_ratio (set_lr_scale)",
}
"""Top-level DeepSpeed keys a `train.deepspeed_config` file may not set, and why."""


def builtin_deepspeed_config(s: EngineSettings) -> dict[str, Any]:
    """The DeepSpeed config the SAO fields give: one micro-batch per step, torch's AdamW (no op to compile)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": s.grad_clip,
        "zero_optimization": {"stage": s.zero_stage},
        "bf16": {"enabled": False},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": s.lr,
                "weight_decay": s.weight_decay,
                "betas": [0.9, s.beta2],
                "eps": s.eps,
                "torch_adam": True,
            },
        },
        "steps_per_print": 10**9,
    }


def read_deepspeed_file(path: str | Path) -> dict[str, Any]:
    """A `train.deepspeed_config` file as a dict; errors name the field and the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"train.deepspeed_config: no such file {path} (a relative path is taken from the "
            f"working directory {Path.cwd()})"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"train.deepspeed_config: {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"train.deepspeed_config: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def merge_deepspeed_config(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override` merged in, table by table: override's leaves win, base's other keys stay
    (a file that sets `optimizer.params.eps` keeps the configured lr and betas)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_deepspeed_config(merged[key], value)
        else:
            merged[key] = value
    return merged


def deepspeed_file_problems(config: dict[str, Any], max_stage: int = 3) -> list[str]:
    """What a file merged into the built-in config may not do here: set a key the learner owns, turn on fp16
    (bf16 only: the non-finite guard has no loss scale), or ask for a ZeRO stage above `max_stage`."""
    problems = [f"{key}: may not be set ({why})" for key, why in SAO_OWNED_KEYS.items() if key in config]
    problems += [
        f"{key}: must be 1 (the learner takes one optimizer step per batch; train.micro_batch_tokens sets its "
        f"micro-batches), got {config[key]!r}"
        for key in ONE_STEP_KEYS
        if config.get(key, 1) != 1
    ]
    if (config.get("fp16") or {}).get("enabled"):
        problems.append("fp16.enabled: fp16 is not supported (no loss scaling in the step); use bf16")
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in range(max_stage + 1):
        problems.append(f"zero_optimization.stage: ZeRO stage {stage!r} is not supported here (0-{max_stage})")
    return problems


class _RecordingDict(dict):
    """A dict that records the keys read from it (get, [], in, `in .keys()`), so that the keys DeepSpeed never
    reads (DeepSpeed ignores unknown top-level keys) can be found. `copy.copy` shares the record."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def keys(self) -> KeysView:
        owner = self

        class _Keys(KeysView):
            def __contains__(self, key: object) -> bool:
                return key in owner

        return _Keys(self)


def deepspeed_schema_problems(config: dict[str, Any]) -> list[str]:
    """DeepSpeed's own validation of a full config: its pydantic models for `zero_optimization`, `bf16` and
    `fp16` (unknown or mistyped keys fail: extra="forbid"), then `DeepSpeedConfig` on the whole, and every
    top-level key DeepSpeed never reads. Each problem starts with the dotted key."""
    default_accelerator()
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import (
        DeepSpeedBF16Config,
        DeepSpeedFP16Config,
    )
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    problems = []
    for section, model in (
        ("zero_optimization", DeepSpeedZeroConfig),
        ("bf16", DeepSpeedBF16Config),
        ("fp16", DeepSpeedFP16Config),
    ):
        value = config.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            problems.append(f"{section}: must be an object, got {value!r}")
            continue
        try:
            model(**value)
        except pydantic.ValidationError as exc:
            problems += [f"{'.'.join(map(str, (section, *err['loc'])))}: {err['msg']}" for err in exc.errors()]
    if problems:
        return problems
    recording = _RecordingDict(copy.deepcopy(config))  # DeepSpeed may edit nested tables
    try:
        DeepSpeedConfig(recording)
    except Exception as exc:  # DeepSpeed raises assertions, ValueErrors and pydantic errors alike: report any
        return [f"DeepSpeedConfig: {type(exc).__name__}: {exc}"]
    return [f"{key}: unknown DeepSpeed key (DeepSpeed never reads it)" for key in sorted(set(config) - recording.read)]


def resolve_deepspeed_config(s: EngineSettings) -> dict[str, Any]:
    """The DeepSpeed config an engine runs with: the built-in one, with the `train.deepspeed_config` file merged over
    it and checked (a ValueError naming `train.deepspeed_config`, the file and every problem)."""
    config = builtin_deepspeed_config(s)
    if s.deepspeed_config:
        config = merge_deepspeed_config(config, read_deepspeed_file(s.deepspeed_config))
        problems = deepspeed_file_problems(config) + deepspeed_schema_problems(config)
        if problems:
            raise ValueError(f"train.deepspeed_config: {s.deepspeed_config}: " + "; ".join(problems))
    return config
