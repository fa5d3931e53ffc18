"""Training engines for the policy and the critic: plain torch, or DeepSpeed.

The step functions in `algorithms.py` only need:
- `.module`, to run forward passes;
- `.backward_step(loss) -> grad_norm`, which does backward, clipping and an optimizer step, and skips
  non-finite updates;
- `.state_dict()` / `.load_state_dict()`, which carry module and optimizer state for checkpoints.

The DeepSpeed engine wraps `deepspeed.initialize`. Policy and critic are two engines, each with its own
optimizer and learning rate, as in OpenRLHF. On CPU it runs in fp32 with gloo (`DS_ACCELERATOR=cpu`).
ZeRO stages 0-2 are supported. Stage 3 would need DeepSpeed's forward for parameter gathering, which the
chunked log-prob path does not use yet.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor, nn


class _Checkpointable:
    """Module + optimizer state for checkpoints (both engines keep `module`, `optimizer`, `skipped_steps`),
    and the learning rate as a scale of the configured one (`base_lr`): schedules and rollbacks set it."""

    def set_lr_scale(self, scale: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * scale

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])  # first: an optimizer may pick up the module's weights
        self._load_optimizer(state)
        self.skipped_steps = state["skipped_steps"]

    def _load_optimizer(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


class TorchEngine(_Checkpointable):
    """AdamW on the trainable parameters, global-norm clipping, non-finite guard."""

    def __init__(self, module: nn.Module, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 beta2: float = 0.95) -> None:
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


class DeepSpeedEngine(_Checkpointable):
    """`deepspeed.initialize` around one model (fp32 on CPU, bf16 on GPU when `bf16` is set)."""

    def __init__(self, module: nn.Module, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 zero_stage: int = 0, bf16: bool = False, beta2: float = 0.95) -> None:
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage: {zero_stage} is not supported here (0, 1 or 2)")
        init_single_process_group()
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": grad_clip,
            "zero_optimization": {"stage": zero_stage},
            "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay,
                                                      "betas": [0.9, beta2], "torch_adam": True}},
            "steps_per_print": 10**9,
        }
        params = [p for p in module.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=module, model_parameters=params,
                                                                 config=config)
        self.module = self.engine.module
        self.base_lr = lr
        self.zero_stage = zero_stage
        self.skipped_steps = 0

    def _load_optimizer(self, state: dict) -> None:
        """ZeRO-1/2 optimizers load from the list of every rank's partition (`optimizer_ranks`, set by the
        learner); stage 0 from this rank's own state."""
        if self.zero_stage:
            self.optimizer.load_state_dict(state.get("optimizer_ranks") or [state["optimizer"]])
        else:
            self.optimizer.load_state_dict(state["optimizer"])

    def backward_step(self, loss: Tensor) -> Tensor:
        from components.training.collective import from_environment

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
        self.engine.step()
        norm = self.engine.get_global_grad_norm()  # of the step just taken (read after step, never before)
        return torch.tensor(float(norm) if norm is not None else math.nan)


def init_single_process_group() -> None:
    """torch.distributed with world size 1 (gloo) unless a launcher (torchrun) already set it up."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")


ENGINES = {"torch": TorchEngine, "deepspeed": DeepSpeedEngine}
