"""The critic on a rank of its own (`train.critic_ranks`): what overlapping the policy's first forward pass with
the critic's K updates buys (issue 26, components/training/rl/placement.py).

`make bench BENCH=placement`. Two gloo ranks on this machine, one torch thread each (a core each on a 2-core
machine): the policy on rank 0, the critic on rank 1, `tiny-cpu`'s model (built from its config, untrained: time
does not depend on the weights) on a synthetic batch of `ROWS` rows of `LENGTH` tokens, the second half actions,
rollout log-probs the policy's own. Each step is `train_step` on an `Apart` placement as the learner runs it, with the overlap (the
default) or without it (`overlap=False`: the policy waits for the critic's values before its forward pass), the
two arms alternating step by step after `WARMUP` steps of each, so drift on a shared machine hits both alike. A
step's time is rank 0's wall clock from a common barrier to the end of its policy update.

What to expect: the policy ranks wait the critic's K = 2 updates plus the values' forward (about 7 forward
passes' worth); without the overlap the policy's forward and backward follow (about 3), with it the forward
(about 1) is already done: a step about 10% shorter. Both arms give the same weights (tests/training/test_micro.py
and test_distributed.py check it); this measures only the time.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from components.rollout.engine_process import free_port

WARMUP = 2
ROWS, LENGTH = 16, 256


def _steps() -> int:
    """Measured steps an arm (`BENCH_PLACEMENT_STEPS`, default 12)."""
    return int(os.environ.get("BENCH_PLACEMENT_STEPS", "12"))


def _batch(model, vocab: int) -> dict[str, torch.Tensor]:
    from components.models.logprobs import token_logprobs

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(9, vocab, (ROWS, LENGTH), generator=gen)
    action = torch.zeros(ROWS, LENGTH)
    action[:, LENGTH // 2 :] = 1
    rewards = torch.zeros(ROWS, LENGTH)
    rewards[:, -1] = torch.randint(0, 2, (ROWS,), generator=gen).float()
    with torch.no_grad():
        logprobs = token_logprobs(model, ids) * action
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(ROWS, LENGTH, dtype=torch.long),
        "action_mask": action,
        "rollout_logprobs": logprobs,
        "versions": torch.zeros(ROWS, LENGTH, dtype=torch.long),
        "rewards": rewards,
    }


def _rank(rank: int, port: int, results) -> None:
    from components.config import load_config
    from components.models import ValueModel, build_policy, freeze_attention
    from components.models.tokenizer import build_tokenizer
    from components.training.engines.collective import from_environment
    from components.training.engines.engine import TorchEngine
    from components.training.engines.settings import EngineSettings
    from components.training.rl.algorithms import settings_from
    from components.training.rl.placement import Apart
    from components.training.rl.step import train_step

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = from_environment()
    placement = Apart.split(world, 1)
    placements = {True: placement, False: dataclasses.replace(placement, overlap=False)}
    cfg = load_config("tiny-cpu")
    tokenizer = build_tokenizer()
    model = build_policy(cfg.model, tokenizer)
    batch = _batch(model, len(tokenizer))
    if placement.role == "policy":
        policy, critic = TorchEngine(model, EngineSettings(cfg.train.policy_lr)), None
    else:
        value = ValueModel.from_policy(copy.deepcopy(model))
        freeze_attention(value)
        policy, critic = None, TorchEngine(value, EngineSettings(cfg.train.critic_lr))
    settings = settings_from(cfg)
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(2 * (WARMUP + _steps())):
        overlap = step % 2 == 0
        world.barrier()
        began = time.perf_counter()
        whole = batch if rank == 0 else None
        train_step(policy, critic, batch, settings, {}, placements[overlap], whole)
        if step >= 2 * WARMUP:
            times[overlap].append(time.perf_counter() - began)
    if rank == 0:
        results.put(times)
    world.barrier()
    dist.destroy_process_group()


def run() -> None:
    results = mp.get_context("spawn").Queue()
    mp.spawn(_rank, args=(free_port(), results), nprocs=2, join=True)
    times = results.get()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"\n== critic on a rank of its own: 1 + 1 gloo ranks, {ROWS} x {LENGTH} tokens, {_steps()} steps an arm ==")
    print(f"  policy waits for the critic (baseline)  median step {off * 1e3:8.1f} ms")
    print(f"  policy's first forward overlapped       median step {on * 1e3:8.1f} ms")
    print(f"  overlapped / baseline: {on / off:.3f}")


if __name__ == "__main__":
    run()
