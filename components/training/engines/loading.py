"""Models into training engines, for every stage that trains (SFT, value pretraining, RL): an engine's settings,
its DeepSpeed config and the dtype it trains in, its model loaded straight into ZeRO-3 partitions when the stage
runs at ZeRO-3, and activation checkpointing.

Loading: under ZeRO-3 a model loads straight into its partitions, in the engine's dtype (bf16 when the DeepSpeed
config enables it): transformers' `from_pretrained` runs under `deepspeed.zero.Init` while a `HfDeepSpeedConfig`
of the engine's config is alive, so no rank ever holds a whole fp32 copy. The critic's backbone is loaded from the
policy's directory, not copied from a loaded policy.

What an engine is told (its optimizer's numbers, backend, ZeRO stage, DeepSpeed file, activation checkpointing) is an
`EngineSettings` (settings.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from components.models import ValueModel
from components.models.value import HEAD_FILE
from components.training.engines.collective import Collective, local_device
from components.training.engines.engine import ENGINES, init_single_process_group
from components.training.engines.settings import EngineSettings


def train_dtype(ds_config: dict | None) -> torch.dtype:
    """The dtype an engine trains (and its model loads) in: bf16 when its DeepSpeed config enables it."""
    return torch.bfloat16 if (ds_config or {}).get("bf16", {}).get("enabled") else torch.float32


def load_model(
    ds_config: dict | None, load: Callable[[torch.dtype], nn.Module], into_partitions: bool = True
) -> nn.Module:
    """`load(dtype)` in the engine's dtype, into ZeRO-3 partitions over every rank when `ds_config` is a ZeRO-3
    config and `into_partitions` (the process group must exist: `init_single_process_group`). An engine on some of
    the ranks only (`train.critic_ranks`) loads its model whole and DeepSpeed partitions it over its group as it
    starts: transformers' `from_pretrained` partitions over every rank."""
    if ds_config is not None:
        init_single_process_group()
    with loading_into_partitions(ds_config if into_partitions else None):
        return load(train_dtype(ds_config))


def open_engine(
    settings: EngineSettings,
    ds_config: dict | None,
    model: nn.Module,
    device: torch.device | None = None,
    comm: Collective | None = None,
):
    """The engine training `model` (`ds_config` = `settings.deepspeed()`): activation checkpointing as set, on this
    rank's device, data-parallel over `comm`'s ranks (default: every rank)."""
    if settings.activation_checkpointing:
        enable_activation_checkpointing(model)
    if ds_config is None:
        return ENGINES["torch"](model, settings, device=device or local_device())
    return ENGINES["deepspeed"](model, settings, config=ds_config, comm=comm)


def initial_critic(sft_dir: Path, critic_path: str, dtype: torch.dtype = torch.float32) -> ValueModel:
    """The critic RL starts from: the pretrained one at `critic_path` (`train.critic_path`, a `ValueModel.save`
    directory), which must match the policy's hidden and vocabulary sizes; or, when the path is empty, the
    decoder of the policy at `sft_dir` with a fresh head. A resumed run then restores the critic from its
    checkpoint."""
    if not critic_path:
        return ValueModel.from_policy_dir(sft_dir, dtype)
    path = Path(critic_path)
    if not path.is_dir():
        raise FileNotFoundError(f"train.critic_path: {path} is not a directory")
    if not (path / HEAD_FILE).is_file():
        raise FileNotFoundError(f"train.critic_path: {path} has no {HEAD_FILE} (not a ValueModel.save directory)")
    critic = ValueModel.load(path, dtype)
    policy_config = load_policy_config(sft_dir)
    for name in ("hidden_size", "vocab_size"):
        theirs, ours = getattr(critic.backbone.config, name), getattr(policy_config, name)
        if theirs != ours:
            raise ValueError(
                f"train.critic_path: the critic at {path} has {name}={theirs}, the policy has {name}={ours}"
            )
    return critic


def load_policy_config(path: Path) -> PretrainedConfig:
    """The config.json of the model directory at `path`, without its weights."""
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


@contextlib.contextmanager
def loading_into_partitions(ds_config: dict | None) -> Iterator[None]:
    """While inside, transformers' `from_pretrained` loads into ZeRO-3 partitions (`ds_config` a ZeRO-3 config);
    with None, or another stage, it loads whole models as usual."""
    if ds_config is None or ds_config["zero_optimization"].get("stage", 0) != 3:
        yield
        return
    # Imported here: transformers' DeepSpeed integration imports deepspeed, which only ZeRO-3 runs need to load.
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep = HfDeepSpeedConfig(ds_config)  # transformers holds a weak reference: alive exactly while we load
    try:
        yield
    finally:
        del keep
        unset_hf_deepspeed_config()


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder layer's activations in the backward pass (transformers' own mechanism, which runs
    in training mode). Training mode must change nothing else, so a model with dropout is refused: RL's
    log-probs must be those of the sampling distribution."""
    config = getattr(model, "config", None) or model.backbone.config
    dropouts = {k: v for k, v in config.to_dict().items() if "dropout" in k and isinstance(v, float) and v}
    if dropouts:
        raise ValueError(
            f"train.activation_checkpointing: the model has dropout {dropouts}; training mode would change "
            f"its log-probs (set them to 0 in config.json, or turn activation checkpointing off)"
        )
    target = model.backbone if isinstance(model, ValueModel) else model
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5.2x; before, the older name
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()


def whole_module(engine, driver: bool) -> nn.Module | None:
    """`engine`'s module whole on the host with its current weights, to save (an HF directory, a critic), in the
    driving process (None in the others). Every rank calls it: under ZeRO-3 the weights are gathered from every
    rank's partition, bucket by bucket, into a module of the same architecture built on the meta device (nothing is
    allocated twice; its non-persistent buffers stay unset, which saving never reads); elsewhere, with the module on
    the host, it is the engine's own module."""
    module = engine.module
    if not getattr(engine, "partitioned", False) and next(module.parameters()).device.type == "cpu":
        return module if driver else None
    state: dict = {}
    for part in engine.full_state():
        state.update(part)
    if not driver:
        return None
    with torch.device("meta"):
        if isinstance(module, ValueModel):
            whole = ValueModel(
                AutoModel.from_config(module.backbone.config), nn.Linear(module.value_head.in_features, 1)
            )
        else:
            whole = AutoModelForCausalLM.from_config(module.config)
    whole.load_state_dict(state, assign=True)
    return whole.eval()
