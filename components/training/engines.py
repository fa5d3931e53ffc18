"""Training engines for the policy and the critic: plain torch, or DeepSpeed.

The step functions in `algorithms.py` only need:
- `.module`, to run forward passes;
- `.backward_step(loss) -> grad_norm`, which does backward, clipping and an optimizer step, and skips
  non-finite updates;
- `.skip_update()`, which counts an update the step decided not to take (non-finite inputs);
- `.state_dict()` / `.load_state_dict()`, which carry module and optimizer state for checkpoints.

The DeepSpeed engine wraps `deepspeed.initialize`. Policy and critic are two engines, each with its own
optimizer and learning rate, as in OpenRLHF. On CPU it runs in fp32 with gloo (`DS_ACCELERATOR=cpu`).
ZeRO stages 0-2 are supported. Stage 3 would need DeepSpeed's forward for parameter gathering, which the
chunked log-prob path does not use yet: it reads the LM head's weight directly (`token_logprobs`).

A DeepSpeed JSON file (`train.deepspeed_config`, e.g. `infra/deepspeed/zero2-bf16.json`) is merged over the
built-in config, the file winning key by key (`deepspeed_config`). The learner owns the batch shape (one
optimizer step per `backward_step`) and the learning-rate schedule, so a file may not set those.

Non-finite guard: an inf or NaN in the loss, or in any gradient on any rank, skips the update on every rank
together (one rank stepping while another skips would desynchronise the replicas), leaves weights and
optimizer state untouched, empties the gradients so the next step starts clean, and adds one to
`skipped_steps` (saved in checkpoints; logged as `trainer/skipped_steps`, docs/metrics.md).
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import time
from collections.abc import Iterator, KeysView
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pydantic
import torch
import torch.distributed as dist
from torch import Tensor, nn

from components.training.collective import from_environment


class _Checkpointable:
    """Module + optimizer state for checkpoints (both engines keep `module`, `optimizer`, `skipped_steps`),
    the learning rate as a scale of the configured one (`base_lr`): schedules and rollbacks set it, and the
    count of skipped updates."""

    def set_lr_scale(self, scale: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * scale

    def state_dict(self) -> dict:
        return {
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])  # first: an optimizer may pick up the module's weights
        self._load_optimizer(state)
        self.skipped_steps = state["skipped_steps"]

    busy_s: float = 0.0
    """Wall seconds of the algorithm steps' work timed with `busy()` (the critic's K updates): what the loop
    benchmark splits a step by. Not checkpointed."""

    @contextmanager
    def busy(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - began

    def skip_update(self) -> Tensor:
        """Count an update the step skipped before its backward (non-finite inputs, decided on every rank
        together); returns a NaN grad norm, as a non-finite loss does."""
        self.skipped_steps += 1
        return torch.tensor(math.nan)

    def _load_optimizer(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


class TorchEngine(_Checkpointable):
    """AdamW on the trainable parameters, global-norm clipping, non-finite guard."""

    def __init__(
        self, module: nn.Module, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0, beta2: float = 0.95
    ) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"{type(module).__name__} has no trainable parameters")
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=(0.9, beta2))
        self.base_lr = lr
        self.grad_clip = grad_clip
        self.skipped_steps = 0

    def backward_step(self, loss: Tensor) -> Tensor:
        """Backward, clip, step. A non-finite loss or gradient skips the update and is counted."""
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            self.skipped_steps += 1
            return torch.tensor(math.nan)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            return norm.detach()
        self.optimizer.step()
        return norm.detach()


ONE_STEP_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""DeepSpeed keys that must stay 1: the learner takes one optimizer step per `backward_step`."""
SAO_OWNED_KEYS = {
    "train_batch_size": "train.batch_size sets the batch; the learner takes one optimizer step per backward_step",
    "scheduler": "the learning-rate schedule is train.warmup_steps / train.min_lr_ratio (set_lr_scale)",
}
"""Top-level DeepSpeed keys a `train.deepspeed_config` file may not set, and why."""


def builtin_deepspeed_config(
    lr: float,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    zero_stage: int = 0,
    bf16: bool = False,
    beta2: float = 0.95,
) -> dict[str, Any]:
    """The DeepSpeed config the SAO fields give: one micro-batch per step, torch's AdamW (no op to compile)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bf16},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "weight_decay": weight_decay, "betas": [0.9, beta2], "torch_adam": True},
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
        f"{key}: must be 1 (the learner takes one optimizer step per backward_step), got {config[key]!r}"
        for key in ONE_STEP_KEYS
        if config.get(key, 1) != 1
    ]
    if (config.get("fp16") or {}).get("enabled"):
        problems.append("fp16.enabled: fp16 is not supported (no loss scaling in the step); use bf16")
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in range(max_stage + 1):
        problems.append(
            f"zero_optimization.stage: ZeRO stage {stage!r} is not supported here (0-{max_stage}); "
            f"stage 3 partitions the parameters, and the chunked log-prob path, checkpoints and weight "
            f"publishing read them outside DeepSpeed's forward"
        )
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


class DeepSpeedEngine(_Checkpointable):
    """`deepspeed.initialize` around one model (fp32 on CPU, bf16 on GPU when `bf16` is set or the config file
    enables it)."""

    def __init__(
        self,
        module: nn.Module,
        lr: float,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        zero_stage: int = 0,
        bf16: bool = False,
        beta2: float = 0.95,
        config_file: str = "",
    ) -> None:
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage: {zero_stage} is not supported here (0, 1 or 2)")
        config = builtin_deepspeed_config(lr, weight_decay, grad_clip, zero_stage, bf16, beta2)
        if config_file:
            config = merge_deepspeed_config(config, read_deepspeed_file(config_file))
            problems = deepspeed_file_problems(config, max_stage=2) + deepspeed_schema_problems(config)
            if problems:
                raise ValueError(f"train.deepspeed_config: {config_file}: " + "; ".join(problems))
        init_single_process_group()
        import deepspeed

        params = [p for p in module.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=module, model_parameters=params, config=config)
        self.module = self.engine.module
        self.config = config
        self.base_lr = config["optimizer"]["params"]["lr"]
        self.zero_stage = config["zero_optimization"].get("stage", 0)
        if self.zero_stage == 0 and self.engine.world_size == 1:
            # Stage 0 on one rank: the gradient all-reduce after each backward flattens, "averages" over one
            # rank and copies back every gradient (about 2% of the tiny preset's step); without it the
            # gradients are the same bits. ZeRO-1/2 keep it: their reduction fills the optimizer's partitions.
            self.engine.enable_backward_allreduce = False
        if self.zero_stage:
            # A ZeRO-1/2 optimizer checks its gradient partition for inf/NaN before the update, all-reduces the
            # flag (`has_overflow`), and on overflow skips the update and empties its averaged-gradient buffers
            # (stage_1_and_2.py `step`), when this flag is set. DeepSpeed sets it from the precision config: off
            # in fp32 (where only a computed non-finite grad norm stops the step) and off in bf16 when a file says
            # `bf16.check_grad_overflow: false` (then a NaN gradient is applied: test_numerical_faults.py).
            self.optimizer.check_grad_overflow = True
        self.skipped_steps = 0

    def _load_optimizer(self, state: dict) -> None:
        """ZeRO-1/2 optimizers load from the list of every rank's partition (`optimizer_ranks`, set by the
        learner); stage 0 from this rank's own state."""
        if self.zero_stage:
            self.optimizer.load_state_dict(state.get("optimizer_ranks") or [state["optimizer"]])
        else:
            self.optimizer.load_state_dict(state["optimizer"])

    def backward_step(self, loss: Tensor) -> Tensor:
        # Ranks skip together: one rank skipping its backward would leave the others in the gradient all-reduce.
        if not from_environment().all_true(bool(torch.isfinite(loss))):
            self.skipped_steps += 1
            return torch.tensor(math.nan)
        self.engine.backward(loss)
        if self.zero_stage == 0:
            # Stage 0 keeps whole (already averaged) gradients on the parameters, and DeepSpeed's fp32 path
            # discards the norm it clips with, so measure it here; it is the same on every rank.
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
            if not torch.isfinite(norm):
                self.engine.zero_grad()
                self.skipped_steps += 1
                return norm.detach()
            self.engine.step()
            return norm.detach()
        # ZeRO-1/2 gradients live in per-rank partitions, so the check is the optimizer's own, inside `step`,
        # before its update (`check_grad_overflow`, set in __init__). A skipped step still counts as DeepSpeed's
        # step (global_steps and its own skipped_steps advance; there is no DeepSpeed lr scheduler to advance),
        # so every backward_step is one `engine.step()`, stepped or not.
        self.engine.step()
        if not self.engine.was_step_applied():
            self.skipped_steps += 1
            return torch.tensor(math.nan)
        norm = self.engine.get_global_grad_norm()  # of the step just taken (read after step, never before)
        return torch.tensor(float(norm) if norm is not None else math.nan)


def default_accelerator() -> None:
    """`DS_ACCELERATOR` for DeepSpeed, unless set: cuda when torch sees a GPU, else cpu. Before importing it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")


def init_single_process_group() -> None:
    """torch.distributed with world size 1 (gloo) unless a launcher (torchrun) already set it up."""
    if dist.is_initialized():
        return
    default_accelerator()
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(
            {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        )
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")


ENGINES = {"torch": TorchEngine, "deepspeed": DeepSpeedEngine}
