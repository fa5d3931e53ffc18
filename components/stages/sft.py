"""The SFT stage: the policy fine-tuned on the distilled dataset, saved as an HF model directory, and its
held-out accuracy.

    data/sft-<env>-<hash>/traces.parquet --SFT--> models/sft-<env>/ (+ sao_sft.json: its recipe and result)

A complete policy whose recipe (dataset recipe, model and SFT settings; components/stages/recipes.py) equals this
config's is reused from the home or the store; a policy trained with another config is retrained.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from components.config import Config
from components.data.traces import read_traces
from components.envs.registry import env_tools
from components.models import build_policy, save_model_dir, start_chat
from components.stages.distill import run_distill
from components.stages.evaluate import run_eval
from components.stages.home import SFT_RECIPE_FILE, Log, existing_sft, publish
from components.stages.recipes import eval_task, sft_key, sft_recipe
from components.storage import atomic_dir, weights_fingerprint, write_json
from components.training.sft import train_sft


def run_sft(cfg: Config, home: Path, force: bool = False, log: Log = print) -> Path:
    """Train the SFT policy from scratch (or from `model.path`) and save it as an HF model directory, or reuse the
    complete one of this recipe (`force`: retrain)."""
    key = sft_key(cfg)
    found = None if force else existing_sft(cfg, home, log)
    if found is not None:
        log(f"sft: reusing the complete SFT policy at {found} (--force retrains)")
        publish(cfg, home, key, log, again=False)
        return found
    out = Path(home) / key
    traces = read_traces(run_distill(cfg, home, log))
    chat = start_chat(cfg.model)
    tokenizer = chat.tokenizer
    model = build_policy(cfg.model, tokenizer, seed=cfg.sft.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"sft: {type(model).__name__} with {n_params / 1e6:.2f}M parameters, {len(traces)} traces, "
        f"{cfg.sft.steps} steps x {cfg.sft.batch_size}"
    )
    result = train_sft(model, chat, traces, cfg.sft, log, env_tools(cfg))
    with atomic_dir(out) as tmp:
        save_model_dir(model, tokenizer, tmp)
        write_json(tmp / SFT_RECIPE_FILE, {"recipe": sft_recipe(cfg), "result": asdict(result)})
    log(f"sft: saved {out}")
    publish(cfg, home, key, log)
    return out


def sft_eval(cfg: Config, sft_dir: Path, home: Path, log: Log = print) -> float:
    """Held-out accuracy of the SFT policy, reusing `reports/sft-eval.json` when it scored these exact weights
    on this held-out set."""
    path = home / "reports" / "sft-eval.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("weights") == weights_fingerprint(sft_dir) and saved.get("eval_task") == eval_task(cfg):
            log(f"eval: reusing {path} ({saved['accuracy']:.1%})")
            return saved["accuracy"]
    return run_eval(cfg, sft_dir, home, "sft-eval", log=log).accuracy
