"""A training checkpoint as a model directory that evaluation and serving can load.

Checkpoints hold the learner's states (`policy.pt`: module and optimizer state, see
components/training/checkpoint.py). Evaluation needs an HF directory: the policy is rebuilt from the SFT
directory's config and tokenizer, the checkpoint's module weights are loaded into it, and the result is written
atomically under `models/<name>-<algo>-step-<N>/` (reused when complete).
"""

from __future__ import annotations

from pathlib import Path

from components.config import Config
from components.models import load_policy, load_tokenizer, save_model_dir
from components.pipeline.store import Log
from components.storage import atomic_dir, is_complete, write_json


def export_checkpoint(cfg: Config, home: Path, step: int, sft_dir: Path, log: Log = print) -> Path:
    """The policy of checkpoint `step` (from the store, verified) as an HF directory under the home."""
    from components.training.trainer import checkpoint_store

    out = Path(home) / "models" / f"{cfg.name}-{cfg.train.algo}-step-{step}"
    if is_complete(out):
        return out
    store = checkpoint_store(cfg, home)
    payload = store.load(step)  # IncompleteArtifact / CorruptArtifact name the checkpoint
    policy = load_policy(sft_dir)
    policy.load_state_dict(payload["policy"]["module"])
    with atomic_dir(out) as tmp:
        save_model_dir(policy, load_tokenizer(sft_dir), tmp)
        write_json(tmp / "checkpoint.json", {"step": step, "source": store.store.uri(store.key(step))})
    log(f"checkpoint: exported step {step} to {out}")
    return out
