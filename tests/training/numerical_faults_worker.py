"""Run by test_numerical_faults.py under `torchrun --nproc-per-node 2`: only rank 1 sees the fault (a NaN
gradient on ZeRO 0, 1 and 2; a NaN reward in its rows of an SAO step on ZeRO-2). Each rank writes, per case,
whether the faulted update left its weights alone, whether the clean one after it moved them, and where to."""

import math
import sys
from pathlib import Path

import torch

from components.config import load_config
from components.models import ValueModel, build_policy, build_tokenizer, freeze_attention, token_logprobs
from components.training.engines.collective import end_rank_process, from_environment, take_rows
from components.training.engines.engine import DeepSpeedEngine, init_single_process_group
from components.training.engines.settings import EngineSettings
from tests.training.test_numerical_faults import SETTINGS, K, OneShot, make_batch, same, weights


def gradient_case(model: torch.nn.Module, stage: int, rank: int) -> dict:
    engine = DeepSpeedEngine(model, EngineSettings(1e-3, zero_stage=stage))
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(rank))  # each rank its own rows
    start = weights(engine)
    if rank == 1:
        # The last parameter: under ZeRO-1/2 rank 0 owns the first half of the flat partition, so the NaN lands
        # in rank 1's partition only, and rank 0 learns of it through the all-reduced overflow flag alone.
        OneShot([p for p in engine.module.parameters() if p.requires_grad][-1], math.nan)
    engine.backward_step(-token_logprobs(engine.module, ids).mean())
    unchanged = same(weights(engine), start)
    engine.backward_step(-token_logprobs(engine.module, ids).mean())
    after = weights(engine)
    return {
        "skipped": engine.skipped_steps,
        "expected_skipped": 1,
        "unchanged": unchanged,
        "moved": not same(after, start),
        "after": torch.cat([w.flatten() for w in after]),
    }


def sao_case(model: torch.nn.Module, rank: int) -> dict:
    batch = take_rows(make_batch(model), range(2 * rank, 2 * rank + 2))
    policy = DeepSpeedEngine(model, EngineSettings(1e-3, zero_stage=2))
    torch.manual_seed(1)
    value_model = ValueModel.from_policy(policy.module)
    freeze_attention(value_model)
    critic = DeepSpeedEngine(value_model, EngineSettings(1e-2, zero_stage=2))
    comm = from_environment()
    faulty = {k: v.clone() for k, v in batch.items()}
    if rank == 1:
        faulty["rewards"][0, 15] = math.nan
    start = weights(policy, critic)
    from components.training.rl.placement import Together
    from components.training.rl.step import train_step

    train_step(policy, critic, faulty, SETTINGS, {}, Together(comm))
    unchanged = same(weights(policy, critic), start)
    train_step(policy, critic, batch, SETTINGS, {}, Together(comm))
    after = weights(policy, critic)
    assert critic.skipped_steps == K, critic.skipped_steps
    return {
        "skipped": policy.skipped_steps,
        "expected_skipped": 1,
        "unchanged": unchanged,
        "moved": not same(after, start),
        "after": torch.cat([w.flatten() for w in after]),
    }


def main(out: str) -> None:
    torch.set_num_threads(1)
    init_single_process_group()
    rank = from_environment().rank
    results = {}
    for stage in (0, 1, 2):
        model = build_policy(load_config("tiny-cpu").model, build_tokenizer(), seed=0)
        results[f"zero{stage}"] = gradient_case(model, stage, rank)
    results["sao-zero2"] = sao_case(build_policy(load_config("tiny-cpu").model, build_tokenizer(), seed=0), rank)
    torch.save(results, Path(out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_rank_process()  # every rank's work is written: the interpreter's teardown may abort in gloo's threads
