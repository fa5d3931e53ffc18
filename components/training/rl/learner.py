"""The learner: policy and critic engines on this rank, and the algorithm step, data-parallel under torchrun.

Rank 0 runs the agent loop (components/training/rl/trainer.py) and drives the other ranks with five messages
(`Message(kind, payload)`), scattered so that each rank receives only its own part:

    step      StepWork      every rank runs the step on its rows (step.py; the placement split them)
    save      directory     every rank writes its own checkpoint files under the directory
    load      directory     every rank restores its own states from them
    weights   Share | None  every rank joins the gathers of the policy's whole weights (ZeRO-3); with a Share
                            (`rollout.transfer_senders = "all"`) each other policy rank packs its buckets of the
                            version to send them itself (components/rollout/senders.py) and answers in a gather
    stop      None          the other ranks return

With one process there is no messaging at all; the learner just runs the step.

Devices: each rank trains on its own device (`local_device`: its GPU, else the host). Batches are built on the
host and scattered as objects; a rank moves its rows to its device, and returns detached host metrics.

Loading (components/training/engines/loading.py): under ZeRO-3 both models load straight into their partitions, in the
engines' dtype; the critic's backbone is loaded from the SFT directory, not copied from the policy.

Checkpoints are directories: `policy/` and `critic/` hold each engine's own files (DeepSpeed's per-rank files,
written by every rank: nothing is gathered), `learner.pt` the algorithm's state and the world size. Rank 0 and
the others must see the same directory: on one machine they do; across machines the run home must be on a
filesystem every node mounts (a rank that cannot see it fails the checkpoint naming the directory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from components.config import Config
from components.models import freeze_attention, load_policy
from components.models.routing import enable_replay, routes_shape
from components.rollout.senders import FollowerSender, Share
from components.storage import HomeStateError
from components.training.engines.collective import (
    from_environment,
    launched_world_size,
    local_device,
)
from components.training.engines.engine import init_single_process_group
from components.training.engines.loading import initial_critic, load_model, open_engine, train_dtype
from components.training.engines.settings import EngineSettings
from components.training.rl.algorithms import ALGORITHMS, AlgoSettings
from components.training.rl.passes import reference_logprobs
from components.training.rl.placement import Apart, Placement, StepWork, Together
from components.training.rl.step import train_step

LEARNER_FILE = "learner.pt"
"""The learner's own part of a checkpoint directory: the algorithm's state and the world size."""


class Message(NamedTuple):
    """What rank 0 scatters to every rank (the module docstring lists the kinds)."""

    kind: str
    payload: object = None


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
        settings = {
            "policy": EngineSettings.rl(tc, tc.policy_lr),
            "critic": EngineSettings.rl(tc, tc.critic_lr, critic=True),
        }
        configs = {name: s.deepspeed() for name, s in settings.items()}
        self.dtype = train_dtype(configs["policy"])
        if self.settings.kl_anchor and (configs["policy"] or {}).get("zero_optimization", {}).get("stage", 0) == 3:
            raise ValueError(
                f"algo.kl_anchor: {self.settings.kl_anchor} holds a whole copy of the SFT policy on every rank, which ZeRO "
                "stage 3 (the policy's DeepSpeed config) partitions to fit; set algo.kl_anchor = 0 or use stage 0-2"
            )
        apart = self._apart(tc)
        roles = {"policy", "critic"} if apart is None else {apart.role}
        whole = apart is None
        groups = {name: None if whole else apart.group for name in ("policy", "critic")}
        torch.manual_seed(cfg.sft.seed)
        policy_model = critic_model = None
        if "policy" in roles:
            policy_model = load_model(configs["policy"], lambda dtype: load_policy(sft_dir, dtype), whole)
            if cfg.algo.routing_replay == "r3":  # the policy's forwards route recorded tokens as the engine did
                routes_shape(policy_model)
                enable_replay(policy_model)
        self.reference = None
        """The frozen SFT policy of `algo.kl_anchor` on the ranks that train the policy (None: no anchor)."""
        if self.settings.kl_anchor and policy_model is not None:
            self.reference = self._reference()
        self.policy = self.critic = None
        if self.algorithm.uses_critic and "critic" in roles:
            critic_model = load_model(
                configs["critic"], lambda dtype: initial_critic(self.sft_dir, tc.critic_path, dtype), whole
            )
            if self.algorithm.freeze_critic_attention:
                freeze_attention(critic_model)
        if critic_model is not None:  # the critic's engine first, as it always was (the runs' numbers stay)
            self.critic = open_engine(
                settings["critic"], configs["critic"], critic_model, self.device, groups["critic"]
            )
        if policy_model is not None:
            self.policy = open_engine(
                settings["policy"], configs["policy"], policy_model, self.device, groups["policy"]
            )
        self.comm = from_environment()  # the DeepSpeed engines initialised torch.distributed
        self.placement: Placement = apart or Together(self.comm)
        self._sender: FollowerSender | None = None
        """This rank's sender of its buckets of each version (a policy rank other than 0, once a Share came)."""

    def _reference(self) -> nn.Module:
        """A frozen copy of the SFT policy in the trainer's dtype on this rank's device."""
        reference = load_policy(self.sft_dir, self.dtype).to(self.device).eval()
        reference.requires_grad_(False)
        return reference

    def _apart(self, tc) -> Apart | None:
        """The critic on ranks of its own (`train.critic_ranks`), or None: both models on every rank."""
        if not tc.critic_ranks:
            return None
        if not self.algorithm.uses_critic or tc.backend != "deepspeed":
            raise ValueError(
                f"train.critic_ranks: {tc.critic_ranks} places a critic on ranks of its own, which needs an algorithm "
                f"with a critic and the deepspeed backend (train.algo = {tc.algo!r}, train.backend = {tc.backend!r})"
            )
        critic_config = EngineSettings.rl(tc, tc.critic_lr, critic=True).deepspeed() or {}
        stage = critic_config["zero_optimization"].get("stage", 0)
        if stage == 3:
            raise ValueError(
                f"train.critic_ranks: {tc.critic_ranks} needs ZeRO stage 0-2, got 3: DeepSpeed 0.19's ZeRO-3 checks "
                f"its parameter trace with broadcasts over every rank (partitioned_param_coordinator.reset_step), "
                f"which an engine on part of the ranks cannot match"
            )
        init_single_process_group()
        return Apart.split(from_environment(), tc.critic_ranks)

    @property
    def is_driver(self) -> bool:
        return self.comm.is_driver

    @property
    def policy_ranks(self) -> int:
        """The ranks that hold the policy: all, or the first ones when the critic has ranks of its own."""
        return self.placement.policy_ranks if isinstance(self.placement, Apart) else self.comm.world

    # ---- rank 0 --------------------------------------------------------------------------------------------

    def step(
        self, batch: dict[str, torch.Tensor], lr_scale: float = 1.0, update_policy: bool = True, version: int = -1
    ) -> dict:
        """One algorithm step on the whole batch (each rank takes its rows), both learning rates at `lr_scale`
        times the configured ones; `update_policy=False` updates the critic only (its warm-up); `version` is the
        policy version being trained (`rollout/mismatch_kl`). Returns whole-batch metrics."""
        work = self.placement.work(batch, lr_scale, self.settings.group_size)
        work = [dataclasses.replace(w, update_policy=update_policy, version=version) for w in work]
        if not self.comm.distributed:
            return self._step(work[0])
        return self._step(self.comm.scatter([Message("step", w) for w in work]).payload)

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

    def weights(self, copy: bool = False, share: Share | None = None) -> dict[str, torch.Tensor]:
        """The policy's whole state on rank 0, on the host: for the engines to serve and for the HF export. Where
        nothing is partitioned and the weights are on the host, the live tensors (valid until the next step)
        unless `copy`; under ZeRO-3 every rank joins the gathers, bucket by bucket. With `share`, every other policy
        rank packs its buckets of `share.version` too, and `share.staged` says whether all of them did."""
        share = share if self.comm.distributed else None
        if share is not None or (self.comm.distributed and self.partitioned):
            self.comm.scatter([Message("weights", share)] * self.comm.world)
        state: dict[str, torch.Tensor] = {}
        for part in self.policy.full_state():
            state.update(part)
        if share is not None:
            failed = [f"rank {r}: {e}" for r, e in enumerate(self.comm.gather(None)) if e]
            share.staged = not failed
            if failed:  # the version goes from rank 0 alone; the next share tries again
                print(f"sao: weights v{share.version}: not staged on every sender ({'; '.join(failed)})", flush=True)
        if self.partitioned:
            return state  # the gathers made fresh host copies: nothing live to copy
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
            self.comm.scatter([Message("stop")] * self.comm.world)

    def close(self) -> None:
        """Every rank, once the run is over: tear down the process group of a multi-process run (a single
        process keeps its group for the next run in the same process)."""
        if self.comm.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def _command(self, kind: str, directory: Path) -> None:
        """Every rank runs `kind` on `directory`; rank 0 raises if any rank failed, naming it."""
        if self.comm.distributed:
            self.comm.scatter([Message(kind, directory)] * self.comm.world)
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
            "weights": self._weights,
        }
        while True:
            message = self.comm.scatter(None)
            if message.kind == "stop":
                return
            handlers[message.kind](message.payload)

    def _weights(self, share: Share | None) -> None:
        """This rank's part of `weights`: join the gathers; with `share`, a policy rank packs its buckets of the
        version and every rank answers in the gather (an error's text, or None)."""
        sender = self.comm.rank if share is not None and self.policy is not None else None
        keep = share.names(sender) if sender is not None and sender < share.senders else set()
        parts: dict[str, torch.Tensor] = {}
        for part in self.policy.full_state(keep=keep) if self.policy is not None else ():
            parts.update({k: v for k, v in part.items() if k in keep})
        if share is None:
            return
        error = None
        if keep:
            try:
                if self._sender is None or self._sender.run != share.run:
                    self._sender = FollowerSender(sender, share, self.device)
                self._sender.stage(share, parts)
            except Exception as exc:  # answered: rank 0 sends this version alone
                error = f"{type(exc).__name__}: {exc}"
        self.comm.gather(error)

    def _step(self, work: StepWork) -> dict:
        """This rank's part of a step (its rows, on this rank's device, at the learning rates' scale)."""
        torch.set_num_threads(self.threads)  # per thread: the engine thread keeps its own budget
        rows = {k: v.to(self.device) for k, v in work.rows.items()}
        if self.reference is not None and work.update_policy:
            rows["reference_logprobs"] = reference_logprobs(self.reference, rows, self.settings)
        whole = None if work.whole is None else {k: v.to(self.device) for k, v in work.whole.items()}
        for engine in (self.policy, self.critic):
            if engine is not None:
                engine.set_lr_scale(work.lr_scale)
        metrics = train_step(
            self.policy,
            self.critic,
            rows,
            self.settings,
            self.state,
            self.placement,
            whole,
            work.update_policy,
            work.version,
        )
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
