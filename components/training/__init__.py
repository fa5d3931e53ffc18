"""Training: `rl/` the RL loop (the trainer, the learner and its one step, the buffer, checkpoints, the collapse
guard, recording and replay); `engines/` how a model trains on this rank (the torch and DeepSpeed engines, their
settings and DeepSpeed config, loading into ZeRO-3 partitions, collectives over ranks, micro-batches); `sft.py` and
`value_pretrain.py` the two supervised stages' loops; `plan/` the GPU memory planner. `rl/` uses `engines/`, never the
reverse; SFT and value pretraining use `engines/` and not `rl/`."""
