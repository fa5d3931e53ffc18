"""The SFT stage: the policy fine-tuned on the distilled dataset, saved as an HF model directory, and its
held-out accuracy.

    data/sft-<env>-<hash>/traces.parquet --SFT--> models/sft-<env>/ (+ sao_sft.json: its recipe and result)

A complete policy whose recipe (dataset recipe, model and SFT settings; components/stages/recipes.py) equals this
config's is reused from the home or the store; a policy trained with another config is retrained.

Under torchrun rank 0 runs the stage (`run_sft`) and the other ranks follow it (`join_sft`): with
`sft.backend = "deepspeed"` every rank trains its rows of each batch (components/training/sft.py); with the torch
backend rank 0 trains alone while the others wait for the directory.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from components.config import Config
from components.data.traces import read_traces
from components.envs.registry import env_tools
from components.models import build_policy, save_model_dir, start_chat
from components.stages.distill import run_distill
from components.stages.evaluate import run_eval
from components.stages.home import SFT_RECIPE_FILE, Log, existing_sft, given_policy, publish
from components.stages.nodes import across_nodes, check_shared_home
from components.stages.recipes import eval_task, sft_key, sft_recipe
from components.storage import atomic_dir, weights_fingerprint, write_json
from components.training.engines.collective import SOLO, Collective, from_environment, launched_world_size, rank_cores
from components.training.engines.engine import init_single_process_group
from components.training.engines.loading import load_model, open_engine, whole_module
from components.training.engines.settings import EngineSettings
from components.training.sft import train_sft


def run_sft(cfg: Config, home: Path, force: bool = False, log: Log = print) -> Path:
    """Train the SFT policy from scratch (or from `model.path`) and save it as an HF model directory, or reuse the
    complete one of this recipe (`force`: retrain), or take the directory `sft.policy` names as it is. Under torchrun this is rank 0's part: it tells the other ranks
    (`join_sft`) what happens, and with `sft.backend = "deepspeed"` every rank trains its rows of each batch."""
    comm = world(home)
    if cfg.sft.policy:
        given = given_policy(cfg)
        log(f"sft: starting from the given policy {given} (sft.policy: no distill, no SFT)")
        comm.broadcast(("done", str(given)))
        return given
    key, recipe = sft_key(cfg), sft_recipe(cfg)
    found = None if force else existing_sft(cfg.store, home, key, recipe, log)
    if found is not None:
        log(f"sft: reusing the complete SFT policy at {found} (--force retrains)")
        publish(cfg.store, home, key, log, again=False)
        comm.broadcast(("done", str(found)))
        return found
    out = Path(home) / key
    traces_path = run_distill(cfg, home, log)
    together = comm.distributed and cfg.sft.backend == "deepspeed"
    if together:
        comm.broadcast(("train", str(traces_path)))
    model, result, chat = _train(cfg, traces_path, comm if together else SOLO, log)
    with atomic_dir(out) as tmp:
        save_model_dir(model, chat.tokenizer, tmp)
        write_json(tmp / SFT_RECIPE_FILE, {"recipe": recipe, "result": asdict(result)})
    log(f"sft: saved {out}")
    publish(cfg.store, home, key, log)
    comm.broadcast(("done", str(out)))
    return out


def join_sft(cfg: Config, home: Path) -> Path:
    """A non-zero torchrun rank's part of `run_sft`: train its rows when rank 0 trains with DeepSpeed, then the SFT
    policy's directory (under the run home, which every rank sees)."""
    comm = world(home)
    kind, value = comm.broadcast(None)
    if kind == "train":
        _train(cfg, Path(value), comm, lambda _: None)
        kind, value = comm.broadcast(None)
    return Path(value)


def world(home: Path) -> Collective:
    """The torchrun world (its process group set up), or `SOLO` in one process. Across nodes every rank first checks
    that it sees the run home rank 0 writes (components/stages/nodes.py), once per process and home."""
    if launched_world_size() > 1:
        init_single_process_group()
    comm = from_environment()
    if across_nodes() and str(home) not in _HOMES_CHECKED:
        check_shared_home(comm, home)
        _HOMES_CHECKED.add(str(home))
    return comm


_HOMES_CHECKED: set[str] = set()


def _train(cfg: Config, traces_path: Path, comm: Collective, log: Log):
    """(the trained policy, whole on the host in the driving process, else None; the result; the chat format):
    SFT's steps on this rank (`comm` the ranks training together)."""
    traces = read_traces(traces_path)
    chat = start_chat(cfg.model)
    settings = EngineSettings.sft(cfg)
    ds_config = settings.deepspeed()

    model = load_model(ds_config, lambda dtype: build_policy(cfg.model, chat.tokenizer, cfg.sft.seed, dtype))
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    log(
        f"sft: {type(model).__name__} with {n_params / 1e6:.2f}M parameters, {len(traces)} traces, "
        f"{cfg.sft.steps} steps x {cfg.sft.batch_size}, backend {settings.backend} on {comm.world} rank(s)"
    )
    if comm.distributed:  # one process keeps torch's own count, as it always has
        torch.set_num_threads(cfg.train.threads or rank_cores())
    engine = open_engine(settings, ds_config, model)
    result = train_sft(
        engine,
        chat,
        traces,
        cfg.sft,
        log,
        env_tools(cfg),
        comm=comm,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
    )
    return whole_module(engine, driver=comm.is_driver), result, chat


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
