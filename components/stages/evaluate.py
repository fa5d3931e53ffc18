"""The evaluate stage: a checkpoint, a model directory or the SFT policy on a benchmark through the one episode
path, then the model registry.

    checkpoint step N -> HF directory (models/<name>-<algo>-step-<N>/) -> episodes (greedy + K samples)
                      -> reports/<name>.{json,parquet} -> registry `candidate`, `champion` when it wins

Checkpoints hold the learner's states (`policy/`: the engine's own files, components/training/rl/learner.py).
Evaluation needs an HF directory: the policy is rebuilt from the SFT directory's config and tokenizer, the
checkpoint's module weights are loaded into it (consolidated from every rank's partition for a ZeRO-3 checkpoint),
and the result is written atomically (reused when complete).
"""

from __future__ import annotations

from pathlib import Path

from components.agent.runner import episode_limits
from components.config import Config
from components.contracts.task import Task
from components.contracts.trajectory import write_trajectories
from components.envs.registry import build_env
from components.eval.benchmarks import load_benchmark
from components.eval.evaluate import EvalReport, evaluate
from components.models import load_chat, load_policy, load_tokenizer, save_model_dir
from components.rollout.embedded import EmbeddedEngine
from components.stages.home import Log, find_sft
from components.stages.recipes import eval_task
from components.storage import atomic_dir, is_complete, weights_fingerprint, write_json
from components.tracking.registry import Promotion, promote
from components.training.engines.engine import read_module_state
from components.training.rl.algorithms import ALGORITHMS
from components.training.rl.checkpoint import checkpoint_store


def eval_tasks(cfg: Config, benchmark: str, tasks: str) -> tuple[list[Task] | None, str]:
    """(tasks, eval set name): a benchmark file, or None for the environment's held-out set."""
    if not tasks:
        return None, f"{cfg.env.name}-heldout"
    return load_benchmark(benchmark or "auto", tasks), f"{benchmark or 'benchmark'}:{Path(tasks).name}"


def model_to_score(
    cfg: Config, home: Path, model: str, checkpoint_step: int | None, log: Log = print
) -> tuple[Path, str | None, str]:
    """(HF directory, the URI to register or None, a name for reports): `model`, checkpoint `checkpoint_step`, or
    by default the newest checkpoint of this config, else the SFT policy (which is not registered). Nothing is
    trained here: a checkpoint is rebuilt on the complete SFT policy of this config, which must exist."""
    if model:
        return Path(model), None, Path(model).name
    store = checkpoint_store(cfg, home)
    step = checkpoint_step if checkpoint_step is not None else store.latest_step()
    sft_dir = find_sft(cfg, home, log)
    if sft_dir is None:
        raise FileNotFoundError(
            f"eval: no complete SFT policy of this config in {home} or its store (`sao sft` "
            f"trains one); evaluation rebuilds checkpoints on it"
        )
    if step is None:
        return sft_dir, None, "sft"
    return export_checkpoint(cfg, home, step, sft_dir, log), store.store.uri(store.key(step)), f"step-{step}"


def export_checkpoint(cfg: Config, home: Path, step: int, sft_dir: Path, log: Log = print) -> Path:
    """The policy of checkpoint `step` (from the store, verified) as an HF directory under the home."""
    out = Path(home) / "models" / f"{cfg.name}-{cfg.train.algo}-step-{step}"
    if is_complete(out):
        return out
    store = checkpoint_store(cfg, home)
    module = store.load(step, lambda directory: read_module_state(directory / "policy"))  # verified first
    policy = load_policy(sft_dir)
    policy.load_state_dict(module)
    with atomic_dir(out) as tmp:
        save_model_dir(policy, load_tokenizer(sft_dir), tmp)
        write_json(tmp / "checkpoint.json", {"step": step, "source": store.store.uri(store.key(step))})
    log(f"checkpoint: exported step {step} to {out}")
    return out


def run_eval(
    cfg: Config,
    model_dir: Path,
    home: Path,
    name: str,
    samples: int = 1,
    log: Log = print,
    tasks: list[Task] | None = None,
    eval_set: str | None = None,
) -> EvalReport:
    """Evaluation of `model_dir` in `cfg.env` on the episode path (greedy, plus `samples` sampled episodes per task
    when > 1): on `tasks` (a benchmark, named `eval_set`) or the environment's held-out set; writes
    `reports/<name>.json` and every trajectory to `reports/<name>.parquet`."""
    setup = build_env(cfg, log)  # as a run starts: style prefers the schedule's first style
    tasks = tasks if tasks is not None else setup.eval_tasks()
    log(f"eval: {len(tasks)} {eval_set or cfg.env.name + ' held-out'} tasks x {samples} sample(s), {model_dir}")
    chat = load_chat(model_dir, cfg.model.chat_format)
    tokenizer = chat.tokenizer
    engine = EmbeddedEngine(load_policy(model_dir), tokenizer, max_batch=cfg.rollout.max_batch).start()
    try:
        report = evaluate(
            engine,
            chat,
            setup.env,
            tasks,
            episode_limits(cfg),
            samples,
            concurrency=cfg.rollout.max_batch,
            seed=cfg.task.seed,
        )
    finally:
        engine.shutdown()
    trajectories = report.greedy + ([t for s in report.sampled for t in s] if samples > 1 else [])
    write_trajectories(home / "reports" / f"{name}.parquet", trajectories)
    write_json(
        home / "reports" / f"{name}.json",
        {
            **report.summary(),
            "model": str(model_dir),
            "weights": weights_fingerprint(model_dir),
            "eval_task": eval_task(cfg) if eval_set is None else {"benchmark": eval_set},
            "samples_text": [
                {
                    "task": t.prompt_id,
                    "output": tokenizer.decode(t.token_ids[t.prompt_len :]),
                    "reward": t.reward,
                    "finish_reason": t.finish_reason,
                }
                for t in report.greedy[:20]
            ],
        },
    )
    return report


def register(
    cfg: Config, client, run_id: str | None, source: str, accuracy: float, eval_set: str, label: str
) -> Promotion:
    """The checkpoint's policy, and its critic when the algorithm has one, as registered model versions (both
    point at the checkpoint, which holds both); returns the policy's promotion."""
    tags = {"sao.checkpoint": label, "sao.algo": cfg.train.algo}
    policy = promote(client, f"{cfg.name}-{cfg.env.name}-policy", source, run_id, accuracy, eval_set, tags)
    if ALGORITHMS[cfg.train.algo].uses_critic:
        promote(client, f"{cfg.name}-{cfg.env.name}-critic", source, run_id, accuracy, eval_set, tags)
    return policy
