"""Training engines for the policy and the critic: plain torch, or DeepSpeed.

The step functions in `algorithms.py` only need:
- `.module`, to run forward passes (always through module calls: under ZeRO-3 a parameter holds only this
  rank's partition, and DeepSpeed's hooks gather it around each module's forward and backward);
- `.accumulate(loss, last)`, the backward of one micro-batch, and `.apply() -> grad_norm`, the optimizer step on
  what the step's micro-batches accumulated, clipped, with the non-finite guard; `.backward_step(loss)` is both
  for a step of one micro-batch;
- `.skip_update()`, which counts an update the step decided not to take (non-finite inputs).
Checkpoints go through `.save(directory)` / `.load(directory)`: the DeepSpeed engine writes DeepSpeed's own
per-rank files (every rank writes its partition of the optimizer state, and under ZeRO-3 of the weights; nothing
is gathered to one rank), the torch engine one file. `.full_state()` yields the whole module's weights on rank 0,
gathered bucket by bucket under ZeRO-3, for publishing and the HF export.

The DeepSpeed engine wraps `deepspeed.initialize`. Policy and critic are two engines, each with its own optimizer
and learning rate, as in OpenRLHF. On CPU it runs in fp32 with gloo (`DS_ACCELERATOR=cpu`), on GPUs in bf16
when the config file enables it. ZeRO stages 0-3; under ZeRO-3 a Mixture-of-Experts block is one leaf module
(its experts' parameters gathered together: DeepSpeed's prefetch follows the order modules ran in, which dynamic
routing changes from step to step; DeepSpeed PR #4966). The config is components/training/engines/deepspeed_config.py's.

Micro-batches: a step's micro-batches each call `accumulate`, the last with `last=True`; DeepSpeed is told where
the accumulation boundary is (`set_gradient_accumulation_boundary`), so its gradient reduction and its step see
one batch, whatever the number of micro-batches. The learner scales each micro-batch's loss by its share of the
batch's tokens (algorithms.py), so the accumulated gradient is the whole batch's.

Non-finite guard: an inf or NaN in a micro-batch's loss, or a micro-batch the caller reports as not finite, skips
the whole update on every rank together (each check is one all-reduce, and every rank runs the same number of
micro-batches, so the ranks agree at the same point); what earlier micro-batches accumulated is discarded. An inf
or NaN in any gradient on any rank skips the update too, at `apply`. A skip leaves weights and optimizer state
untouched, empties the gradients so the next step starts clean, and adds one to `skipped_steps` (saved in
checkpoints; logged as `trainer/skipped_steps`, docs/metrics.md).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from components.training.engines.collective import Collective, from_environment, local_device, process_group_backend
from components.training.engines.deepspeed_config import default_accelerator, resolve_deepspeed_config
from components.training.engines.settings import EngineSettings

ENGINE_FILE = "engine.pt"
"""The torch engine's checkpoint file in its directory."""
PUBLISH_BUCKET_BYTES = 512 * 2**20
"""Parameters gathered at a time under ZeRO-3 when the whole module's weights are read (`full_state`)."""


class _Engine:
    """What both engines share: the learning rate as a scale of the configured one (`base_lr`: schedules and
    rollbacks set it), the count of skipped updates, the step's micro-batch bookkeeping, and timing."""

    module: nn.Module
    optimizer: Any
    base_lr: float
    skipped_steps: int = 0
    _pending: bool = False
    """This step has accumulated at least one micro-batch's gradients."""
    _skipping: bool = False
    """A micro-batch of this step was not finite: the step's remaining micro-batches and its update are skipped."""

    def set_lr_scale(self, scale: float) -> None:
        self.set_lr(self.base_lr * scale)

    def set_lr(self, lr: float) -> None:
        """The learning rate itself (SFT's schedule gives it absolutely)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

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

    def accumulate(self, loss: Tensor, last: bool = True, finite: bool = True) -> bool:
        """Backward of one micro-batch's `loss` (already scaled to its share of the batch); `last`: the step's last
        micro-batch. `finite=False` says the caller found the micro-batch's inputs not finite. Returns False when
        the step is being skipped (this micro-batch or an earlier one was not finite, on some rank): the caller
        stops, and `apply` skips the update."""
        if self._skipping:
            return False
        if not self._all_true(finite and bool(torch.isfinite(loss))):
            self._skipping = True
            if self._pending:
                self._discard()
            return False
        self._backward(loss, last)
        self._pending = True
        return True

    def apply(self) -> Tensor:
        """The optimizer step on the accumulated gradients; returns the gradient norm (NaN when skipped)."""
        skipping, self._skipping, self._pending = self._skipping, False, False
        if skipping:
            return self.skip_update()
        return self._step()

    def backward_step(self, loss: Tensor) -> Tensor:
        """Backward, clip, step: a step of one micro-batch. A non-finite loss or gradient skips it and is counted."""
        self.accumulate(loss, last=True)
        return self.apply()

    def full_state(
        self, bucket_bytes: int = PUBLISH_BUCKET_BYTES, keep: set[str] | None = None
    ) -> Iterator[dict[str, Tensor]]:
        """The module's whole state (weights and persistent buffers) in parts, on rank 0; under ZeRO-3 the other ranks
        must iterate too (the gathers are collective) and get the tensors named in `keep` (default none). Tensors are
        the live ones where nothing is partitioned (valid until the next step; every rank holds all of them), fresh
        host copies under ZeRO-3."""
        yield {k: v.detach() for k, v in self.module.state_dict().items()}

    def _all_true(self, flag: bool) -> bool:
        return flag


class TorchEngine(_Engine):
    """AdamW on the trainable parameters, global-norm clipping, non-finite guard; one process."""

    def __init__(self, module: nn.Module, s: EngineSettings, device: torch.device | str = "cpu") -> None:
        self.module = module.to(device)
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"{type(module).__name__} has no trainable parameters")
        self.optimizer = torch.optim.AdamW(
            self.params, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, s.beta2), eps=s.eps
        )
        self.base_lr = s.lr
        self.grad_clip = s.grad_clip
        self.skipped_steps = 0

    def _backward(self, loss: Tensor, last: bool) -> None:
        loss.backward()

    def _discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _step(self) -> Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            return norm.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach()

    def state_dict(self) -> dict:
        return {
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])  # first: an optimizer may pick up the module's weights
        self.optimizer.load_state_dict(state["optimizer"])
        self.skipped_steps = state["skipped_steps"]

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), directory / ENGINE_FILE)

    def load(self, directory: Path) -> None:
        path = directory / ENGINE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint: {path} is missing (not a torch engine's checkpoint)")
        self.load_state_dict(torch.load(path, weights_only=False, map_location="cpu"))


def moe_leaf_classes(module: nn.Module) -> list[type]:
    """The Mixture-of-Experts block classes in `module` (transformers names them `*SparseMoeBlock`)."""
    found = {type(m) for m in module.modules() if type(m).__name__.endswith("SparseMoeBlock")}
    return sorted(found, key=lambda cls: cls.__name__)


class DeepSpeedEngine(_Engine):
    """`deepspeed.initialize` around one model with the DeepSpeed config of `s` (fp32 unless its file enables bf16).
    `config`, when given, is that config already resolved (the learner resolves it first: under ZeRO-3 the model is
    loaded into its partitions with it); `comm` the ranks it is data-parallel over (default: every rank)."""

    def __init__(
        self, module: nn.Module, s: EngineSettings, config: dict | None = None, comm: Collective | None = None
    ) -> None:
        config = config or resolve_deepspeed_config(s)
        init_single_process_group()
        import deepspeed

        self.zero_stage = config["zero_optimization"].get("stage", 0)
        if self.zero_stage == 3 and (leaves := moe_leaf_classes(module)):
            deepspeed.utils.set_z3_leaf_modules(module, leaves)
        params = [p for p in module.parameters() if p.requires_grad]
        self.comm = comm or from_environment()
        mpu = GroupMPU(self.comm) if self.comm.group is not None else None
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, model_parameters=params, config=config, mpu=mpu
        )
        self.module = self.engine.module
        self.config = config
        self.base_lr = config["optimizer"]["params"]["lr"]
        if self.zero_stage == 0 and self.engine.world_size == 1:
            # Stage 0 on one rank: the gradient all-reduce after each backward flattens, "averages" over one
            # rank and copies back every gradient (about 2% of the tiny preset's step); without it the
            # gradients are the same bits. ZeRO-1/2 keep it: their reduction fills the optimizer's partitions.
            self.engine.enable_backward_allreduce = False
        if self.zero_stage in (1, 2):
            # A ZeRO-1/2 optimizer checks its gradient partition for inf/NaN before the update, all-reduces the
            # flag (`has_overflow`), and on overflow skips the update and empties its averaged-gradient buffers
            # (stage_1_and_2.py `step`), when this flag is set. DeepSpeed sets it from the precision config: off
            # in fp32 (where only a computed non-finite grad norm stops the step) and off in bf16 when a file says
            # `bf16.check_grad_overflow: false` (then a NaN gradient is applied: test_numerical_faults.py). The
            # ZeRO-3 optimizer treats a non-finite gradient norm as an overflow whatever the config.
            self.optimizer.check_grad_overflow = True
        self.skipped_steps = 0

    @property
    def partitioned(self) -> bool:
        """The parameters themselves are partitioned over the ranks (ZeRO-3)."""
        return self.zero_stage == 3

    def _all_true(self, flag: bool) -> bool:
        return self.comm.all_true(flag)

    def _backward(self, loss: Tensor, last: bool) -> None:
        # DeepSpeed's own `engine.forward` starts every micro-step this way; the learner calls the module directly
        # (several forwards per step: the critic's V_old, the policy's log-probs), so each micro-batch is marked
        # here. ZeRO-3 counts its micro-steps by it and, unmarked, overwrites its gradient partitions at every
        # backward instead of accumulating them.
        if hasattr(self.optimizer, "clear_backward_seen_flag"):
            self.optimizer.clear_backward_seen_flag()
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss)

    def _discard(self) -> None:
        """Drop what the step's earlier micro-batches accumulated (every rank together), as DeepSpeed's ZeRO optimizer
        drops a step's gradients when its `step` finds an overflow (stage_1_and_2.py `step`, stage3.py
        `_overflow_clean_up`; DeepSpeed is pinned, tests/training/test_micro.py checks each stage)."""
        optimizer = self.optimizer
        if self.zero_stage in (1, 2):
            from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

            optimizer.micro_step_id = INITIAL_MICRO_STEP_ID
            optimizer.zero_grad(set_to_none=True)
            optimizer._release_preflattened_grad_buffers()
            for group in [*optimizer.averaged_gradients, *optimizer.all_grad_tensors]:
                optimizer.averaged_gradients[group] = None
                optimizer.all_grad_tensors[group] = None  # what the micro-steps so far accumulated
        elif self.zero_stage == 3:
            optimizer.zero_grad(set_to_none=True)  # its micro-step count back to 0: the next backward overwrites
            optimizer.averaged_gradients = {}
        else:
            self.engine.zero_grad()

    def _step(self) -> Tensor:
        if self.zero_stage == 0:
            # Stage 0 keeps whole (already averaged) gradients on the parameters, and DeepSpeed's fp32 path
            # discards the norm it clips with, so measure it here; it is the same on every rank.
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
            if not torch.isfinite(norm):
                self.engine.zero_grad()
                self.skipped_steps += 1
                return norm.detach().cpu()
            self.engine.step()
            return norm.detach().cpu()
        # ZeRO gradients live in per-rank partitions, so the check is the optimizer's own, inside `step`, before
        # its update (`check_grad_overflow`, set in __init__, for ZeRO-1/2). A skipped step still counts as
        # DeepSpeed's step (global_steps and its own skipped_steps advance; there is no DeepSpeed lr scheduler to
        # advance), so every update is one `engine.step()`, stepped or not.
        self.engine.step()
        if not self.engine.was_step_applied():
            self.skipped_steps += 1
            return torch.tensor(math.nan)
        norm = self.engine.get_global_grad_norm()  # of the step just taken (read after step, never before)
        return torch.tensor(float(norm) if norm is not None else math.nan)

    def save(self, directory: Path) -> None:
        """DeepSpeed's checkpoint of this engine under `directory` (every rank calls it and writes its own files)."""
        self.engine.save_checkpoint(
            str(directory.parent),
            tag=directory.name,
            client_state={"sao_skipped_steps": self.skipped_steps},
            save_latest=False,
        )

    def load(self, directory: Path) -> None:
        """Every rank reads its own files of the checkpoint `save` wrote."""
        path, client = self.engine.load_checkpoint(
            str(directory.parent), tag=directory.name, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise FileNotFoundError(f"checkpoint: {directory} holds no DeepSpeed checkpoint of this engine")
        self.skipped_steps = client["sao_skipped_steps"]  # DeepSpeed keeps its own "skipped_steps"

    def full_state(
        self, bucket_bytes: int = PUBLISH_BUCKET_BYTES, keep: set[str] | None = None
    ) -> Iterator[dict[str, Tensor]]:
        if not self.partitioned:
            yield from super().full_state(bucket_bytes)
            return
        import deepspeed

        rank0, keep = self.comm.rank == 0, keep or set()
        bucket: list[tuple[str, nn.Parameter]] = []
        size = 0
        named = list(self.module.named_parameters())
        for i, (name, param) in enumerate(named):
            bucket.append((name, param))
            size += param.ds_numel * param.element_size()
            if size < bucket_bytes and i + 1 < len(named):
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in bucket]):
                yield {n: p.detach().to("cpu", copy=True) for n, p in bucket if rank0 or n in keep}
            bucket, size = [], 0
        yield {n: b.detach().to("cpu", copy=True) for n, b in persistent_buffers(self.module) if rank0 or n in keep}


class GroupMPU:
    """DeepSpeed's "model parallel unit" for an engine on some of the ranks (the critic on ranks of its own,
    `train.critic_ranks`): its data-parallel group is `comm`'s group; there is no model parallelism (each rank's
    model-parallel group is itself)."""

    def __init__(self, comm: Collective) -> None:
        self.comm = comm
        self.alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)

    def get_data_parallel_group(self):
        return self.comm.group

    def get_data_parallel_world_size(self) -> int:
        return self.comm.world

    def get_data_parallel_rank(self) -> int:
        return self.comm.rank

    def get_model_parallel_group(self):
        return self.alone

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def read_module_state(directory: Path) -> dict[str, Tensor]:
    """The whole module state an engine's `save` wrote to `directory`, in one process on the host: the torch
    engine's file, DeepSpeed's model-states file for ZeRO 0-2, or, for ZeRO-3 (whose weights live in every rank's
    partition), DeepSpeed's own consolidation of the fp32 partitions (`zero_to_fp32`)."""
    directory = Path(directory)
    if (directory / ENGINE_FILE).is_file():
        return torch.load(directory / ENGINE_FILE, weights_only=False, map_location="cpu")["module"]
    whole = directory / "mp_rank_00_model_states.pt"
    if whole.is_file():
        return torch.load(whole, weights_only=False, map_location="cpu")["module"]
    if not any(directory.glob("zero_pp_rank_*_model_states.pt")):
        raise FileNotFoundError(f"checkpoint: {directory} holds neither a torch nor a DeepSpeed engine's files")
    default_accelerator()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(directory.parent), tag=directory.name)


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, buffer) of the buffers `module.state_dict()` holds."""
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


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
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device))


ENGINES = {"torch": TorchEngine, "deepspeed": DeepSpeedEngine}
