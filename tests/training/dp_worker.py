"""Run by test_distributed.py, as a plain process and under torchrun: for each case (an algorithm at a ZeRO stage,
with the critic on ranks of its own when the case says `/cN`), two learner steps on the same stored batch, a checkpoint, a third step, then the
checkpoint restored and the third step again; rank 0 writes what it saw, and the policy as an HF directory."""

import sys
from pathlib import Path

import torch

from components.config import load_config
from components.contracts.trajectory import read_trajectories, to_tensors
from components.models import load_tokenizer, save_model_dir
from components.training.engines.collective import end_rank_process
from components.training.engines.engine import init_single_process_group
from components.training.rl.algorithms import settings_from
from components.training.rl.learner import Learner


def _params(learner: Learner) -> torch.Tensor:
    return torch.cat([v.flatten().float() for k, v in sorted(learner.weights(copy=True).items())])


def main(model_dir: str, trajectories: str, out: str, cases: str) -> None:
    init_single_process_group()
    tokenizer = load_tokenizer(model_dir)
    batch = to_tensors(read_trajectories(trajectories), tokenizer.pad_token_id)
    results = {}
    for case in cases.split(","):
        algo, placement = case.rsplit("@", 1)
        zero, _, critic_ranks = placement.partition("/c")  # `algo@stage/cN`: the critic on the last N ranks
        cfg = load_config(
            "tiny-cpu",
            [
                f'train.algo="{algo}"',
                'train.backend="deepspeed"',
                f"train.zero_stage={zero}",
                f"train.critic_ranks={critic_ranks or 0}",
                "train.batch_size=8",
                "train.group_size=4",
            ],
        )
        learner = Learner(cfg, Path(model_dir), settings_from(cfg), threads=1)
        if not learner.is_driver:
            learner.serve()
            continue
        metrics = [{k: float(v) for k, v in learner.step(batch).items()} for _ in range(2)]
        checkpoint = Path(out).parent / f"checkpoint-{Path(out).stem}-{case}"
        learner.save(checkpoint)  # every rank writes its own files
        metrics.append({k: float(v) for k, v in learner.step(batch).items()})
        params = _params(learner)
        learner.load(checkpoint)  # every rank restores its own partition
        resumed = {k: float(v) for k, v in learner.step(batch).items()}
        export = Path(out).parent / f"export-{Path(out).stem}-{case}"
        save_model_dir(learner.serving_module(), tokenizer, export)
        results[case] = {
            "metrics": metrics,
            "resumed": resumed,
            "params": params,
            "params_resumed": _params(learner),
            "world": learner.comm.world,
            "export": str(export),
        }
        learner.release()
    if results:
        torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_rank_process()  # every rank's work is written: the interpreter's teardown may abort in gloo's threads
