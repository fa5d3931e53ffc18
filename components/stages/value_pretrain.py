"""The value-pretraining stage: the critic trained on rollouts of the SFT policy before RL, kept under a key named
by its recipe and reused when the recipe matches.

    SFT policy --rollouts--> split by prompt --> fit_critic (components/training/value_pretrain.py)
               --> models/critic-<env>-<hash>/  ValueModel.save (backbone + value_head.safetensors), value_pretrain.json

The critic starts as training would start it (`ValueModel.from_policy_dir`, attention frozen when `train.algo`
freezes it) and learns with training's loss and optimizer settings (`train.weight_decay`, `grad_clip`,
`adam_beta2`; `value_pretrain.lr`, else `train.critic_lr`) on the engine `value_pretrain.backend` names; under
torchrun rank 0 rolls out and every rank fits its rows when that is DeepSpeed (`join_value_pretrain`). Prompts come
from the environment's training stream with `train.task_seed + PROMPT_SEED_SHIFT`, so the critic is not pretrained
on RL's own first prompts. The built-in coding and style sets are small and cycled: there the shifted seed only
reorders them and the same tasks recur.

Which critic RL starts from is decided here, once, for every entry point (`starting_critic`): `train.critic_path`,
else this recipe's pretrained critic when `value_pretrain.warm_start`, else a cold one.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from components.config import Config
from components.contracts.trajectory import Trajectory, read_trajectories, write_trajectories
from components.envs.registry import build_env
from components.models import ValueModel, freeze_attention, load_tokenizer
from components.stages.home import Log, available, publish
from components.stages.recipes import critic_key, prompt_config, value_pretrain_recipe
from components.stages.rollout import sample_episodes
from components.stages.sft import run_sft, world
from components.storage import atomic_dir, write_json
from components.training.engines.collective import SOLO, Collective, rank_cores
from components.training.engines.loading import load_model, open_engine, whole_module
from components.training.engines.settings import EngineSettings
from components.training.rl.algorithms import ALGORITHMS
from components.training.value_pretrain import FitSettings, fit_critic, split_by_prompt

SUMMARY_FILE = "value_pretrain.json"
"""Written into the critic's directory: the recipe and the numbers of the run."""


@dataclass
class ValuePretrainResult:
    ev_cold: float
    """Held-out explained variance of the cold critic (fresh head), before any update."""
    ev_history: list[float]
    """Held-out explained variance per epoch; index 0 is the cold critic, index e is after epoch e."""
    best_epoch: int
    """The epoch whose weights were saved (0: no epoch beat the cold critic)."""
    ev_best: float
    """Held-out explained variance of the saved critic."""
    episodes: int
    """Rollouts collected (training and held-out parts)."""
    held_out: int
    """Of which held out."""
    seconds: float
    """Wall time, rollouts included."""
    out_dir: Path
    """The saved critic's directory (`ValueModel.load` reads it)."""


def sft_policy(cfg: Config, home: Path, log: Log = print) -> Path:
    """The SFT policy the critic learns the values of (trained first when the home and the store lack it)."""
    return run_sft(cfg, home, log=log)


def run_value_pretrain(cfg: Config, home: Path, sft_dir: Path, log: Log = print) -> tuple[Path, dict]:
    """(critic directory, its summary): the complete critic pretrained from these inputs, or a new one. Under
    torchrun this is rank 0's part; the other ranks follow it (`join_value_pretrain`)."""
    comm = world(home)
    key = critic_key(cfg, sft_dir)
    out = Path(home) / key
    if available(cfg.store, home, key, log):
        log(f"value_pretrain: reusing the complete critic at {out}")
        publish(cfg.store, home, key, log, again=False)
    else:
        pretrain_value(cfg, sft_dir, out, log, comm)
        publish(cfg.store, home, key, log)
    comm.broadcast(("done", str(out)))
    return out, json.loads((out / SUMMARY_FILE).read_text())["result"]


def join_value_pretrain(cfg: Config, home: Path, sft_dir: Path) -> Path:
    """A non-zero torchrun rank's part of `run_value_pretrain` (rank 0 has run `run_sft` first, and so has this rank
    `join_sft`): its rows of the fitting when rank 0 fits with DeepSpeed; the critic's directory."""
    comm = world(home)
    kind, value = comm.broadcast(None)
    if kind == "fit":
        train_part, held_out = (read_trajectories(value[name]) for name in ("train", "held_out"))
        _fit(cfg, sft_dir, train_part, held_out, Path(value["best"]), comm, lambda _: None)
        kind, value = comm.broadcast(None)
    return Path(value)


def uses_critic(cfg: Config) -> bool:
    """`train.algo` trains a value model (and so has a critic to pretrain)."""
    return ALGORITHMS[cfg.train.algo].uses_critic


def starts_warm(cfg: Config) -> bool:
    """RL starts its critic from this recipe's pretrained one (`value_pretrain.warm_start`, for an algorithm with a
    critic)."""
    return uses_critic(cfg) and cfg.value_pretrain.warm_start


def starting_critic(cfg: Config, home: Path, sft_dir: Path, log: Log = print) -> Path | None:
    """The critic RL starts from, by one rule for every entry point (the pipeline, `sao train`, `sao sweep`, `sao
    experiment`): the directory `train.critic_path` names when it is set; else, when `starts_warm`, this recipe's
    pretrained critic, pretrained now when neither the home nor the store holds it complete (what the pipeline's
    value_pretrain stage does before training); else None: a cold critic (the SFT policy's decoder with a fresh
    head), or no critic at all. Under torchrun this is rank 0's part; the other ranks follow it
    (`join_starting_critic`)."""
    if cfg.train.critic_path:
        return Path(cfg.train.critic_path)
    if not starts_warm(cfg):
        return None
    return run_value_pretrain(cfg, home, sft_dir, log)[0]


def join_starting_critic(cfg: Config, home: Path, sft_dir: Path) -> Path | None:
    """A non-zero torchrun rank's part of `starting_critic`."""
    if cfg.train.critic_path:
        return Path(cfg.train.critic_path)
    return join_value_pretrain(cfg, home, sft_dir) if starts_warm(cfg) else None


def with_critic(cfg: Config, critic: Path | None) -> Config:
    """`cfg` training from `critic` (`starting_critic`'s answer): `train.critic_path` set to it, or empty (cold)."""
    return replace(cfg, train=replace(cfg.train, critic_path=str(critic or "")))


def critic_origin(cfg: Config, critic: Path | None) -> str:
    """How a run names the critic it starts from, on its first line."""
    if not uses_critic(cfg):
        return f"no critic ({cfg.train.algo})"
    if critic is None:
        return "a cold critic (a fresh head on the SFT policy; value_pretrain.warm_start = false)"
    how = "pretrained for this recipe" if starts_warm(cfg) and not cfg.train.critic_path else "train.critic_path"
    return f"the critic {critic} ({how})"


def pretrain_value(
    cfg: Config, sft_dir: Path, out_dir: Path, log: Log = print, comm: Collective = SOLO
) -> ValuePretrainResult:
    """Roll out the SFT policy at `sft_dir`, pretrain a critic on the rollouts (`cfg.value_pretrain`) and save
    the best epoch's critic to `out_dir` (written atomically, with `value_pretrain.json` inside). With
    `value_pretrain.backend = "deepspeed"` under torchrun every rank of `comm` fits its rows (rank 0 rolls out and
    hands the rollouts over as Parquet beside `out_dir`, where every rank reads them)."""
    algorithm = ALGORITHMS[cfg.train.algo]
    if not algorithm.uses_critic:
        users = sorted(name for name, a in ALGORITHMS.items() if a.uses_critic)
        raise ValueError(f"train.algo: {cfg.train.algo!r} trains no critic; value pretraining is for {users}")
    start = time.perf_counter()
    train_part, held_out = collect_rollouts(cfg, sft_dir, log)
    scratch = Path(out_dir).parent / f".{Path(out_dir).name}-fit"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    together = comm.distributed and cfg.value_pretrain.backend == "deepspeed"
    try:
        if together:
            parts = {"train": scratch / "train.parquet", "held_out": scratch / "held_out.parquet"}
            write_trajectories(parts["train"], train_part)
            write_trajectories(parts["held_out"], held_out)
            comm.broadcast(("fit", {**{k: str(v) for k, v in parts.items()}, "best": str(scratch / "best")}))
        critic, history, best_epoch = _fit(
            cfg, sft_dir, train_part, held_out, scratch / "best", comm if together else SOLO, log
        )
        result = ValuePretrainResult(
            history[0],
            history,
            best_epoch,
            history[best_epoch],
            len(train_part) + len(held_out),
            len(held_out),
            time.perf_counter() - start,
            Path(out_dir),
        )
        summary = {k: v for k, v in asdict(result).items() if k != "out_dir"}
        with atomic_dir(out_dir) as tmp:
            critic.save(tmp)
            write_json(tmp / SUMMARY_FILE, {"recipe": value_pretrain_recipe(cfg, sft_dir), "result": summary})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(
        f"value-pretrain: kept epoch {best_epoch} (held-out EV {result.ev_cold:.3f} -> {result.ev_best:.3f}), "
        f"{result.seconds:.1f}s; saved {out_dir}"
    )
    return result


def _fit(cfg: Config, sft_dir: Path, train_part, held_out, best_dir: Path, comm: Collective, log: Log):
    """(the critic whole on the host in the driving process, else None; held-out EV per epoch; the best epoch):
    this rank's part of the fitting."""
    vp, tc = cfg.value_pretrain, cfg.train
    settings = EngineSettings.value_pretrain(cfg)
    ds_config = settings.deepspeed()
    torch.manual_seed(vp.seed)  # the fresh value head
    critic = load_model(ds_config, lambda dtype: ValueModel.from_policy_dir(sft_dir, dtype))
    if ALGORITHMS[tc.algo].freeze_critic_attention:
        freeze_attention(critic)
    engine = open_engine(settings, ds_config, critic)
    threads = torch.get_num_threads()
    torch.set_num_threads(tc.threads or rank_cores())  # 0: this rank's share of the cores (nothing else runs now)
    try:
        pad_id = load_tokenizer(sft_dir).pad_token_id
        history, best_epoch = fit_critic(
            engine, train_part, held_out, pad_id, FitSettings.from_config(cfg), best_dir, log, comm
        )
    finally:
        torch.set_num_threads(threads)
    return whole_module(engine, driver=comm.is_driver), history, best_epoch


def collect_rollouts(cfg: Config, sft_dir: Path, log: Log = print) -> tuple[list[Trajectory], list[Trajectory]]:
    """`value_pretrain.episodes` episodes of the SFT policy on the shifted prompt stream (`prompt_config`),
    split by prompt into (training part, held-out part)."""
    vp = cfg.value_pretrain
    setup = build_env(prompt_config(cfg), log)
    tasks = list(itertools.islice(setup.train_tasks(0, 1), vp.episodes))
    # As many in flight as the engine batches (as evaluation does): nothing trains while they run.
    trajectories, seconds = sample_episodes(cfg, sft_dir, setup.env, tasks, vp.seed, cfg.rollout.max_batch)
    train_part, held_out = split_by_prompt(trajectories, vp.held_out_episodes, vp.seed)
    reward = sum(t.reward for t in trajectories) / len(trajectories)
    log(
        f"value-pretrain: {len(trajectories)} {setup.name} episodes in {seconds:.1f}s (reward mean {reward:.3f}); "
        f"{len(train_part)} train / {len(held_out)} held-out prompts"
    )
    return train_part, held_out
