"""The learner: policy and critic engines on this rank, and the algorithm step, data-parallel under torchrun.

Rank 0 runs the agent loop (components/training/trainer.py) and drives the other ranks with four messages,
scattered so that each rank receives only its own part:

    ("step", (rows, lr scale))    every rank runs the algorithm step on its rows; DeepSpeed averages grads
    ("save", None)                every rank hands its engine states to rank 0 (ZeRO partitions differ)
    ("load", states)              every rank restores its own states from a checkpoint
    ("stop", None)                the other ranks return

With one process there is no messaging at all; the learner just runs the step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from components.config import Config
from components.models import ValueModel, freeze_attention, load_policy
from components.models.value import HEAD_FILE
from components.storage import HomeStateError
from components.training.algorithms import ALGORITHMS, AlgoSettings
from components.training.collective import (
    from_environment,
    launched_world_size,
    shard_rows,
    take_rows,
)
from components.training.engines import ENGINES


def initial_critic(policy: torch.nn.Module, critic_path: str) -> ValueModel:
    """The critic RL starts from: the pretrained one at `critic_path` (`train.critic_path`, a `ValueModel.save`
    directory), which must match the policy's hidden and vocabulary sizes; or, when the path is empty, the
    policy's decoder with a fresh head. A resumed run then restores the critic from its checkpoint."""
    if not critic_path:
        return ValueModel.from_policy(policy)
    path = Path(critic_path)
    if not path.is_dir():
        raise FileNotFoundError(f"train.critic_path: {path} is not a directory")
    if not (path / HEAD_FILE).is_file():
        raise FileNotFoundError(f"train.critic_path: {path} has no {HEAD_FILE} (not a ValueModel.save directory)")
    critic = ValueModel.load(path)
    for name in ("hidden_size", "vocab_size"):
        theirs, ours = getattr(critic.backbone.config, name), getattr(policy.config, name)
        if theirs != ours:
            raise ValueError(
                f"train.critic_path: the critic at {path} has {name}={theirs}, the policy has {name}={ours}"
            )
    return critic


class Learner:
    def __init__(self, cfg: Config, sft_dir: Path, settings: AlgoSettings, threads: int) -> None:
        tc = cfg.train
        if launched_world_size() > 1 and tc.backend != "deepspeed":
            raise ValueError(
                f"train.backend: {launched_world_size()} processes need the deepspeed backend "
                f"(gradients are averaged by DeepSpeed), got {tc.backend!r}"
            )
        self.algorithm, self.settings, self.threads = ALGORITHMS[tc.algo], settings, threads
        self.state: dict = {}  # the algorithm's own state (the running-mean baseline), the same on every rank
        torch.manual_seed(cfg.sft.seed)
        policy_model = load_policy(sft_dir)
        make_engine = ENGINES[tc.backend]
        kwargs = {"weight_decay": tc.weight_decay, "grad_clip": tc.grad_clip, "beta2": tc.adam_beta2}
        if tc.backend == "deepspeed":
            kwargs.update(zero_stage=tc.zero_stage, config_file=tc.deepspeed_config)
        self.critic = None
        if self.algorithm.uses_critic:
            critic_model = initial_critic(policy_model, tc.critic_path)
            if self.algorithm.freeze_critic_attention:
                freeze_attention(critic_model)
            self.critic = make_engine(critic_model, tc.critic_lr, **kwargs)
        self.policy = make_engine(policy_model, tc.policy_lr, **kwargs)
        self.comm = from_environment()  # the DeepSpeed engines initialised torch.distributed

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

    def state_dicts(self) -> dict:
        """Checkpoint payload: rank 0's states as `policy`/`critic`, the other ranks' under `peers`."""
        if self.comm.distributed:
            self.comm.scatter([("save", None)] * self.comm.world)
        states = self.comm.gather(self._local_states())
        return {**states[0], "peers": states[1:]}

    def load_state_dicts(self, saved: dict) -> None:
        peers = saved.get("peers", [])
        if len(peers) + 1 != self.comm.world:
            raise HomeStateError(
                f"checkpoint: written by {len(peers) + 1} rank(s), this run has {self.comm.world}; "
                f"resume with the same number of processes"
            )
        ranks = [{k: saved[k] for k in ("policy", "critic", "algo_state") if k in saved}, *peers]
        for name in ("policy", "critic"):  # ZeRO-1/2 optimizers restore from every rank's partition
            if name in ranks[0]:
                everyone = [r[name]["optimizer"] for r in ranks]
                for r in ranks:
                    r[name] = {**r[name], "optimizer_ranks": everyone}
        if self.comm.distributed:
            self.comm.scatter([("load", r) for r in ranks])
        self._load_local(ranks[0])

    def release(self) -> None:
        """Let the other ranks return (rank 0, at the end of the run)."""
        if self.comm.distributed:
            self.comm.scatter([("stop", None)] * self.comm.world)

    def close(self) -> None:
        """Every rank, once the run is over: tear down the process group of a multi-process run (a single
        process keeps its group for the next run in the same process)."""
        if self.comm.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    # ---- every rank ----------------------------------------------------------------------------------------

    def serve(self) -> None:
        """The other ranks: follow rank 0's messages until it says stop."""
        handlers: dict[str, Callable] = {
            "step": self._step,
            "save": lambda _: self.comm.gather(self._local_states()),
            "load": self._load_local,
        }
        while True:
            kind, data = self.comm.scatter(None)
            if kind == "stop":
                return
            handlers[kind](data)

    def _step(self, work: tuple[dict[str, torch.Tensor], float]) -> dict:
        rows, lr_scale = work
        torch.set_num_threads(self.threads)  # per thread: the engine thread keeps its own budget
        for engine in (self.policy, self.critic):
            if engine is not None:
                engine.set_lr_scale(lr_scale)
        return self.algorithm.step(self.policy, self.critic, rows, self.settings, self.state, self.comm)

    def _local_states(self) -> dict:
        states = {"policy": self.policy.state_dict(), "algo_state": self.state}
        if self.critic is not None:
            states["critic"] = self.critic.state_dict()
        return states

    def _load_local(self, states: dict) -> None:
        self.policy.load_state_dict(states["policy"])
        if self.critic is not None:
            self.critic.load_state_dict(states["critic"])
        self.state = states.get("algo_state", {})
