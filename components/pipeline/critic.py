"""The value-pretraining stage: the critic trained on rollouts of the SFT policy before RL
(components/training/value_pretrain.py), kept under a key named by its recipe and reused when the recipe matches.

    models/critic-<env>-<hash>/    ValueModel.save (backbone + value_head.safetensors) and value_pretrain.json
"""

from __future__ import annotations

import json
from pathlib import Path

from components.config import Config
from components.pipeline.store import Log, available, fingerprint, publish


def critic_key(cfg: Config, sft_dir: Path) -> str:
    from components.training.value_pretrain import value_pretrain_recipe

    return f"models/critic-{cfg.env.name}-{fingerprint(value_pretrain_recipe(cfg, sft_dir))}"


def run_value_pretrain(cfg: Config, home: Path, sft_dir: Path, log: Log = print) -> tuple[Path, dict]:
    """(critic directory, its summary): the complete critic pretrained from these inputs, or a new one."""
    from components.training.value_pretrain import pretrain_value

    key = critic_key(cfg, sft_dir)
    out = Path(home) / key
    if available(cfg, home, key, log):
        log(f"value_pretrain: reusing the complete critic at {out}")
        publish(cfg, home, key, log, again=False)
        return out, json.loads((out / "value_pretrain.json").read_text())["result"]
    pretrain_value(cfg, sft_dir, out, log)
    publish(cfg, home, key, log)
    return out, json.loads((out / "value_pretrain.json").read_text())["result"]
