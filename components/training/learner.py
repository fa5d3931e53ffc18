"""The learner: policy and critic engines on this rank, and the algorithm step, data-parallel under torchrun.

Rank 0 runs the agent loop (components/training/trainer.py) and drives the other ranks with five messages,
scattered so that each rank receives only its own part:

    ("step", (rows, lr scale))    every rank runs the algorithm step on its rows; DeepSpeed averages grads
    ("save", directory)           every rank writes its own checkpoint files under the directory
    ("load", directory)           every rank restores its own states from them
    ("weights", None)             every rank joins the gathers of the policy's whole weights (ZeRO-3)
    ("stop", None)                the other ranks return

With one process there is no messaging at all; the learner just runs the step.

Devices: each rank trains on its own device (`local_device`: its GPU, else the host). Batches are built on the
host and scattered as objects; a rank moves its rows to its device, and returns detached host metrics.

Loading: under ZeRO-3 both models load straight into their partitions, in the engines' dtype (bf16 when the
DeepSpeed config enables it): transformers' `from_pretrained` runs under `deepspeed.zero.Init` while a
`HfDeepSpeedConfig` of the engine's config is alive, so no rank ever holds a whole fp32 copy. The critic's
backbone is loaded from the same directory as the policy, not copied from it.

Checkpoints are directories: `policy/` and `critic/` hold each engine's own files (DeepSpeed's per-rank files,
written by every rank: nothing is gathered), `learner.pt` the algorithm's state and the world size. Rank 0 and
the others must see the same directory: on one machine they do; across machines the run home must be on a
filesystem every node mounts (a rank that cannot see it fails the checkpoint naming the directory).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from components.config import Config
from components.models import ValueModel, freeze_attention, load_policy
from components.models.value import HEAD_FILE
from components.storage import HomeStateError
from components.training.algorithms import ALGORITHMS, AlgoSettings
from components.training.collective import (
    from_environment,
    launched_world_size,
    local_device,
    shard_rows,
    take_rows,
)
from components.training.deepspeed_config import resolve_deepspeed_config
from components.training.engines import ENGINES, init_single_process_group

LEARNER_FILE = "learner.pt"
"""The learner's own part of a checkpoint directory: the algorithm's state and the world size."""


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


class Learner:
    def __init__(self, cfg: Config, sft_dir: Path, settings: AlgoSettings, threads: int) -> None:
        tc = cfg.train
        if launched_world_size() > 1 and tc.backend != "deepspeed":
            raise ValueError(
                f"train.backend: {launched_world_size()} processes need the deepspeed backend "
                f"(gradients are averaged by DeepSpeed), got {tc.backend!r}"
            )
        self.algorithm, self.settings, self.threads = ALGORITHMS[tc.algo], settings, threads
        self.sft_dir = Path(sft_dir)
        self.state: dict = {}  # the algorithm's own state (the running-mean baseline), the same on every rank
        self.device = local_device()
        if tc.backend == "deepspeed":
            init_single_process_group()  # before loading: ZeRO-3 partitions over the process group
        configs = {
            "policy": self._deepspeed_config(tc, tc.policy_lr),
            "critic": self._deepspeed_config(tc, tc.critic_lr),
        }
        self.dtype = torch.bfloat16 if (configs["policy"] or {}).get("bf16", {}).get("enabled") else torch.float32
        dtype = self.dtype
        torch.manual_seed(cfg.sft.seed)
        with loading_into_partitions(configs["policy"]):
            policy_model = load_policy(sft_dir, dtype)
        self.critic = None
        critic_model = None
        if self.algorithm.uses_critic:
            with loading_into_partitions(configs["critic"]):
                critic_model = initial_critic(self.sft_dir, tc.critic_path, dtype)
            if self.algorithm.freeze_critic_attention:
                freeze_attention(critic_model)
        if tc.activation_checkpointing:
            for model in (policy_model, critic_model):
                if model is not None:
                    enable_activation_checkpointing(model)
        kwargs = {"weight_decay": tc.weight_decay, "grad_clip": tc.grad_clip, "beta2": tc.adam_beta2}
        make_engine = ENGINES[tc.backend]
        if critic_model is not None:
            self.critic = make_engine(critic_model, tc.critic_lr, **kwargs, **self._placement(configs["critic"]))
        self.policy = make_engine(policy_model, tc.policy_lr, **kwargs, **self._placement(configs["policy"]))
        self.comm = from_environment()  # the DeepSpeed engines initialised torch.distributed

    @staticmethod
    def _deepspeed_config(tc, lr: float) -> dict | None:
        if tc.backend != "deepspeed":
            return None
        return resolve_deepspeed_config(
            lr, tc.weight_decay, tc.grad_clip, tc.zero_stage, beta2=tc.adam_beta2, config_file=tc.deepspeed_config
        )

    def _placement(self, ds_config: dict | None) -> dict:
        """Where an engine lives: a resolved DeepSpeed config (DeepSpeed moves the module to the rank's device),
        or the device for the torch engine."""
        return {"device": self.device} if ds_config is None else {"config": ds_config}

    @property
    def is_driver(self) -> bool:
        return self.comm.rank == 0

    # ---- rank 0 --------------------------------------------------------------------------------------------

    def step(self, batch: dict[str, torch.Tensor], lr_scale: float = 1.0) -> dict:
        """One algorithm step on the whole batch (each rank takes its rows), both learning rates at `lr_scale`
        times the configured ones. Returns whole-batch metrics."""
        if self.comm.distributed:
            rows = shard_rows(len(batch["input_ids"]), self.comm.world, self.settings.group_size)
            batch, lr_scale = self.comm.scatter([("step", (take_rows(batch, r), lr_scale)) for r in rows])[1]
        return self._step((batch, lr_scale))

    def save(self, directory: Path) -> None:
        """Write this learner's checkpoint files under `directory` (every rank writes its own)."""
        self._command("save", directory)

    def load(self, directory: Path) -> None:
        """Restore every rank's states from a checkpoint directory `save` wrote."""
        saved = torch.load(Path(directory) / LEARNER_FILE, weights_only=False)
        if saved["world_size"] != self.comm.world:
            raise HomeStateError(
                f"checkpoint: written by {saved['world_size']} rank(s), this run has {self.comm.world}; "
                f"resume with the same number of processes"
            )
        self._command("load", directory)

    def weights(self, copy: bool = False) -> dict[str, torch.Tensor]:
        """The policy's whole state on rank 0, on the host: for the engines to serve and for the HF export. Where
        nothing is partitioned and the weights are on the host, the live tensors (valid until the next step)
        unless `copy`; under ZeRO-3 every rank joins the gathers, bucket by bucket."""
        if self.comm.distributed and self.partitioned:
            self.comm.scatter([("weights", None)] * self.comm.world)
        state: dict[str, torch.Tensor] = {}
        for part in self.policy.full_state():
            state.update(part)
        if copy or self.device.type != "cpu":
            state = {k: v.to("cpu", copy=True) if v.device.type != "cpu" or copy else v for k, v in state.items()}
        return state

    def serving_module(self) -> nn.Module:
        """The policy with its current weights as a whole module on the host, for an engine to copy: the live
        module where nothing is partitioned and it lives on the host, else a new host copy (under ZeRO-3 the
        trainer's module holds partitions, and on GPU ranks it lives on the GPU)."""
        if not self.partitioned and self.device.type == "cpu":
            return self.policy.module
        model = load_policy(self.sft_dir, self.dtype)
        model.load_state_dict(self.weights())
        return model.eval()

    @property
    def partitioned(self) -> bool:
        """The policy's parameters are partitioned over the ranks (ZeRO-3)."""
        return getattr(self.policy, "partitioned", False)

    def release(self) -> None:
        """Let the other ranks return (rank 0, at the end of the run)."""
        if self.comm.distributed:
            self.comm.scatter([("stop", None)] * self.comm.world)

    def close(self) -> None:
        """Every rank, once the run is over: tear down the process group of a multi-process run (a single
        process keeps its group for the next run in the same process)."""
        if self.comm.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def _command(self, kind: str, directory: Path) -> None:
        """Every rank runs `kind` on `directory`; rank 0 raises if any rank failed, naming it."""
        if self.comm.distributed:
            self.comm.scatter([(kind, directory)] * self.comm.world)
        errors = self.comm.gather(self._handle(kind, directory))
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed:
            raise RuntimeError(f"checkpoint {kind} in {directory} failed: " + "; ".join(failed))

    # ---- every rank ----------------------------------------------------------------------------------------

    def serve(self) -> None:
        """The other ranks: follow rank 0's messages until it says stop."""
        handlers: dict[str, Callable] = {
            "step": self._step,
            "save": lambda directory: self.comm.gather(self._handle("save", directory)),
            "load": lambda directory: self.comm.gather(self._handle("load", directory)),
            "weights": lambda _: [None for _ in self.policy.full_state()],
        }
        while True:
            kind, data = self.comm.scatter(None)
            if kind == "stop":
                return
            handlers[kind](data)

    def _step(self, work: tuple[dict[str, torch.Tensor], float]) -> dict:
        rows, lr_scale = work
        torch.set_num_threads(self.threads)  # per thread: the engine thread keeps its own budget
        rows = {k: v.to(self.device) for k, v in rows.items()}
        for engine in (self.policy, self.critic):
            if engine is not None:
                engine.set_lr_scale(lr_scale)
        metrics = self.algorithm.step(self.policy, self.critic, rows, self.settings, self.state, self.comm)
        return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}

    def _handle(self, kind: str, directory: Path) -> str:
        """This rank's part of a checkpoint save or load; returns an error message ('' when it worked)."""
        directory = Path(directory)
        try:
            engines = {"policy": self.policy, "critic": self.critic}
            for name, engine in engines.items():
                if engine is not None:
                    getattr(engine, kind)(directory / name)
            if kind == "save" and self.is_driver:
                torch.save({"algo_state": self.state, "world_size": self.comm.world}, directory / LEARNER_FILE)
            if kind == "load":
                self.state = torch.load(directory / LEARNER_FILE, weights_only=False)["algo_state"]
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            if not self.comm.distributed:
                raise
            return f"{type(exc).__name__}: {exc}"
        return ""
