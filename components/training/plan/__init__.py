"""`sao plan`, the GPU memory planner: what each GPU holds when a preset trains (weights, gradients, optimizer states,
activations, the LM head's logits, ZeRO's buffers and gathered parameters, NCCL's buffers, the weight transfer's
buckets, a fragmentation reserve) for every ZeRO stage and critic placement, and the cheapest configuration that fits
with 10% of the GPU free.

- `memory.py`: the models' arithmetic, in bytes, with its sources (DeepSpeed's code, Korthikanti et al. 2022);
- `overheads.py`: what a GPU holds besides the models (NCCL, the weight transfer, fragmentation), with its sources;
- `layout.py`: where the models go (shared or separate critic), each GPU's peak, the cheapest plan that fits;
- `model.py`: the architecture (a model directory's or a shipped `config.json`) and parameter counts on the meta
  device;
- `planner.py`: the numbers from a config, and the report `sao plan` prints.
"""

from components.training.plan.planner import report, workload

__all__ = ["report", "workload"]
