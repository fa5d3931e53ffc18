"""Run by test_distributed.py, once as a plain process and once under `torchrun --nproc-per-node 2`: two
learner steps per algorithm on the same stored batch, then a checkpoint round trip. Rank 0 writes what it saw."""

import sys
from pathlib import Path

import torch

from components.config import load_config
from components.contracts.trajectory import read_trajectories, to_tensors
from components.models import load_tokenizer
from components.training.engines import init_single_process_group
from components.training.learner import Learner
from components.training.parts import settings_from


def main(model_dir: str, trajectories: str, out: str, algos: str) -> None:
    init_single_process_group()
    tokenizer = load_tokenizer(model_dir)
    batch = to_tensors(read_trajectories(trajectories), tokenizer.pad_token_id)
    results = {}
    for algo in algos.split(","):
        zero = 2 if algo == "sao" else 0
        cfg = load_config(
            "tiny-cpu",
            [
                f'train.algo="{algo}"',
                'train.backend="deepspeed"',
                f"train.zero_stage={zero}",
                "train.batch_size=8",
                "train.group_size=4",
            ],
        )
        learner = Learner(cfg, Path(model_dir), settings_from(cfg), threads=1)
        if not learner.is_driver:
            learner.serve()
            continue
        metrics = [{k: float(v) for k, v in learner.step(batch).items()} for _ in range(2)]
        saved = learner.state_dicts()
        learner.load_state_dicts(saved)  # every rank restores its own partition
        after_load = {k: float(v) for k, v in learner.step(batch).items()}
        params = torch.cat([p.detach().flatten() for p in learner.policy.module.parameters()])
        results[algo] = {
            "metrics": metrics,
            "after_load": after_load,
            "params": params,
            "world": learner.comm.world,
            "peers": len(saved["peers"]),
        }
        learner.release()
    if results:
        torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
