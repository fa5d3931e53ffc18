"""`sao plan`, the GPU memory planner: what each GPU holds when a preset trains (weights, gradients, optimizer states,
activations, the LM head's logits, ZeRO's buffers) for every ZeRO stage and critic placement, and the cheapest
configuration that fits.

- `memory.py`: the arithmetic, in bytes, with its sources (DeepSpeed's code, Korthikanti et al. 2022);
- `layout.py`: where the models go (shared or separate critic), each GPU's peak, the cheapest plan that fits;
- `model.py`: the architecture (a model directory's or a shipped `config.json`) and parameter counts on the meta
  device;
- `planner.py`: the numbers from a config, and the report `sao plan` prints.
"""

from components.training.plan.planner import report, workload

__all__ = ["report", "workload"]
