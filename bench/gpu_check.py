"""The GPU check (`make gpu-check`; docs/gpu.md, "The GPU check"): the trainer's loop in small, on one device, with
the figures a GPU machine is lent to measure.

    random Qwen3-MoE (Qwen's vocabulary size) -> embedded engine samples a batch -> SAO step (K critic updates, the
    policy update) on one rank -> the new weights to the engine -> ...      at ZeRO-0 and at ZeRO-3, bf16

For each ZeRO stage it prints the step time, the trainer's tokens/s and model FLOPs utilisation (MFU), the
engine's tokens/s, and the peak device memory against `sao plan`'s estimate for the same model, rows and stage;
once, the bf16 log-probs of the sampled tokens against fp32's, and the engine's logged log-probs against the
trainer's (the DIS ratio of version 0 is 1 where they agree).

It imports only torch, transformers, deepspeed, pydantic and the project's training, rollout and model modules (no
Prefect, MLflow, vLLM, pyarrow or an HTTP client), so a bare GPU machine runs it with a few carried wheels
(docs/gpu.md). Without a GPU (`make test` runs it, `--cpu`) the same code runs a tiny model in fp32 on the host: a
check that the script works, not a measurement.

    python -m bench.gpu_check [--cpu] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cuda" if "--cpu" not in sys.argv else "cpu")

import torch  # noqa: E402  (DS_ACCELERATOR must be set before deepspeed is imported, through these)
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from components.config import load_config  # noqa: E402
from components.models import load_policy, token_logprobs  # noqa: E402
from components.rollout.embedded import EmbeddedEngine  # noqa: E402
from components.rollout.protocol import SamplingRequest  # noqa: E402
from components.training.plan.layout import Workload, plan  # noqa: E402
from components.training.plan.memory import Zero  # noqa: E402
from components.training.plan.model import decoder_sizes, policy_and_critic  # noqa: E402
from components.training.rl.algorithms import settings_from  # noqa: E402
from components.training.rl.learner import Learner  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # DeepSpeed's ZeRO-3 calls
H200_BF16_PEAK = 989e12
"""Dense bf16 FLOP/s of an H200 SXM (NVIDIA's figure, without sparsity): MFU's denominator."""


@dataclass(frozen=True)
class Size:
    """The model and the batch a run uses."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_per_token: int
    expert_width: int
    vocab: int
    rows: int
    """Sequences per step."""
    prompt: int
    """Prompt tokens of each sequence."""
    new_tokens: int
    """Tokens the engine samples for each."""
    steps: int
    """Steps per ZeRO stage; the first is a warm-up and is not timed."""


GPU = Size(1024, 8, 16, 4, 64, 32, 4, 512, 151_936, rows=32, prompt=128, new_tokens=384, steps=3)
"""About 0.74B parameters (0.23B active per token), 16,384 tokens a step: one H200 runs both stages in minutes."""
CPU = Size(64, 2, 4, 2, 16, 4, 2, 64, 512, rows=4, prompt=8, new_tokens=8, steps=2)


def build_model_dir(size: Size, path: Path, dtype: torch.dtype) -> Qwen3MoeConfig:
    """A randomly initialised Qwen3-MoE of `size` saved as an HF directory (untied head, as the presets)."""
    config = Qwen3MoeConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.expert_width * size.experts_per_token,
        moe_intermediate_size=size.expert_width,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        num_experts=size.experts,
        num_experts_per_tok=size.experts_per_token,
        max_position_embeddings=4 * (size.prompt + size.new_tokens),
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    return config


def sample(engine: EmbeddedEngine, size: Size, seed: int) -> tuple[dict[str, torch.Tensor], float]:
    """One batch sampled by `engine` (random prompts, no stop token: every row has `new_tokens` actions) as the
    trainer's tensors, outcome rewards 0/1 at random; and the engine's tokens/s."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, size.vocab, (size.rows, size.prompt), generator=gen).tolist()
    futures = [
        engine.submit(SamplingRequest(p, size.new_tokens, 1.0, (), seed=seed * 1000 + i)) for i, p in enumerate(prompts)
    ]
    began = time.perf_counter()
    while engine.step():
        pass
    seconds = time.perf_counter() - began
    results = [f.result() for f in futures]
    length = size.prompt + size.new_tokens
    batch = {
        "input_ids": torch.tensor([r.prompt_ids + r.token_ids for r in results]),
        "attention_mask": torch.ones(size.rows, length, dtype=torch.long),
        "action_mask": torch.cat([torch.zeros(size.rows, size.prompt), torch.ones(size.rows, size.new_tokens)], 1),
        "rollout_logprobs": torch.cat(
            [torch.zeros(size.rows, size.prompt), torch.tensor([r.logprobs for r in results])], 1
        ),
        "versions": torch.zeros(size.rows, length, dtype=torch.long),
        "rewards": torch.zeros(size.rows, length),
    }
    batch["rewards"][:, -1] = torch.randint(0, 2, (size.rows,), generator=gen).float()
    return batch, size.rows * size.new_tokens / seconds


def step_flops(config: Qwen3MoeConfig, size: Size, critic_updates: int) -> float:
    """Model FLOPs of one SAO step: per token, 2 x active parameters a forward pass, twice that a backward, plus
    causal attention's scores and mixing (Kaplan et al. 2020; Korthikanti et al. 2022). The critic runs K forward
    and backward passes and one more forward for the updated values, the policy one of each with its LM head."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = (
        2 * config.hidden_size * (q + kv)
        + config.num_experts_per_tok * 3 * config.hidden_size * (config.moe_intermediate_size)
        + config.hidden_size * config.num_experts
    )
    decoder = config.num_hidden_layers * per_layer
    tokens = size.rows * (size.prompt + size.new_tokens)
    length = size.prompt + size.new_tokens
    attention = config.num_hidden_layers * 2 * 2 * q * length / 2  # QK^T and AV over half the positions (causal)
    forward = 2 * decoder * tokens + attention * tokens
    head = 2 * config.hidden_size * config.vocab_size * size.rows * size.new_tokens  # action tokens only
    critic = critic_updates * 3 * forward + forward
    policy = 3 * (forward + head)
    return critic + policy


def planned_peak(config: Qwen3MoeConfig, size: Size, stage: int, bf16: bool) -> float:
    """`sao plan`'s peak for this model, batch and stage on one GPU, in bytes."""
    policy, critic = policy_and_critic(config, critic=True, frozen_attention=True)
    workload = Workload(
        policy=policy,
        critic=critic,
        decoder=decoder_sizes(config),
        zero=Zero(stage=stage, bf16=bf16),
        batch_size=size.rows,
        longest=size.prompt + size.new_tokens,
        budget=0,
        checkpointing=False,
    )
    return plan(workload, 1, stage, "shared", capacity=math.inf).peak


def logprob_agreement(model_dir: Path, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """bf16 log-probs of the batch's action tokens against fp32's, and the engine's logged ones (version 0, sampled
    in the training dtype: bf16 on a GPU, fp32 on the host) against the trainer's in that dtype (|log ratio|)."""
    act = batch["action_mask"].bool().to(device)
    values = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_policy(model_dir, dtype).to(device)
        with torch.no_grad():
            values[name] = token_logprobs(model, batch["input_ids"].to(device))[act].float()
        del model
    gap = (values["bf16"] - values["fp32"]).abs()
    trained = values["bf16" if device.type == "cuda" else "fp32"]
    engine_gap = (trained - batch["rollout_logprobs"].to(device)[act]).abs()
    return {
        "logprob_bf16_vs_fp32_max": float(gap.max()),
        "logprob_bf16_vs_fp32_mean": float(gap.mean()),
        "engine_vs_trainer_mean_abs_log_ratio": float(engine_gap.mean()),
    }


def run_stage(model_dir: Path, config: Qwen3MoeConfig, size: Size, stage: int, device: torch.device, work: Path):
    """`size.steps` turns of the loop at ZeRO `stage` (bf16 on a GPU, fp32 on the host); the figures, and the first
    batch sampled."""
    bf16 = device.type == "cuda"
    ds_file = work / f"zero{stage}.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}))
    cfg = load_config(
        "tiny-cpu",
        ['train.backend="deepspeed"', f"train.zero_stage={stage}", f'train.deepspeed_config="{ds_file}"'],
    )
    cfg = replace(cfg, train=replace(cfg.train, batch_size=size.rows))
    learner = Learner(cfg, model_dir, settings_from(cfg), threads=torch.get_num_threads())
    engine_model = load_policy(model_dir, learner.dtype).to(device)
    engine = EmbeddedEngine(engine_model, max_batch=size.rows)
    engine_bytes = sum(p.numel() * p.element_size() for p in engine_model.parameters())
    step_s, engine_tps, peaks, first = [], [], [], None
    for step in range(size.steps):
        batch, tokens_per_s = sample(engine, size, seed=step)
        first = first if first is not None else batch
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        metrics = learner.step(batch)
        synchronize(device)
        if step:  # the first step allocates and warms up
            step_s.append(time.perf_counter() - began)
            engine_tps.append(tokens_per_s)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated() - engine_bytes)
        if not all(math.isfinite(float(metrics[k])) for k in ("policy/loss", "critic/loss")):
            raise RuntimeError(f"gpu-check: ZeRO-{stage} step {step} gave non-finite losses: {metrics}")
        engine.load_weights(learner.weights(), step + 1)
        while engine.step():  # applies the new version
            pass
    seconds = sum(step_s) / len(step_s)
    flops = step_flops(config, size, cfg.algo.critic_updates) / seconds
    result = {
        "zero_stage": stage,
        "dtype": "bf16" if bf16 else "fp32",
        "step_s": seconds,
        "trainer_tokens_per_s": size.rows * (size.prompt + size.new_tokens) / seconds,
        "model_tflops_per_s": flops / 1e12,
        "mfu": flops / H200_BF16_PEAK if bf16 else math.nan,
        "engine_tokens_per_s": sum(engine_tps) / len(engine_tps),
        "peak_gb": max(peaks) / 1e9 if peaks else math.nan,
        "planned_peak_gb": planned_peak(config, size, stage, bf16) / 1e9,
    }
    del engine, engine_model, learner
    return result, first


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the host and a tiny model, even where a GPU is present")
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    size = GPU if device.type == "cuda" else CPU
    where = torch.cuda.get_device_name() if device.type == "cuda" else "the host (a check that the script works)"
    print(f"gpu-check: torch {torch.__version__} on {where}; {size}", flush=True)
    figures: dict = {"device": where, "size": asdict(size), "stages": []}
    with tempfile.TemporaryDirectory(prefix="sao-gpu-check-") as tmp:
        work = Path(tmp)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        config = build_model_dir(size, work / "policy", dtype)
        first = None
        for stage in (0, 3):
            result, batch = run_stage(work / "policy", config, size, stage, device, work)
            first = first if first is not None else batch
            figures["stages"].append(result)
            print(_line(result), flush=True)
        figures.update(logprob_agreement(work / "policy", first, device))
    print(
        "log-probs of the sampled tokens: bf16 vs fp32 max |diff| {logprob_bf16_vs_fp32_max:.3g}, mean "
        "{logprob_bf16_vs_fp32_mean:.3g}; engine vs trainer mean |log ratio| {engine_vs_trainer_mean_abs_log_ratio:.3g}".format(
            **figures
        )
    )
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def _line(r: dict) -> str:
    return (
        f"ZeRO-{r['zero_stage']} {r['dtype']}: step {r['step_s']:.3f} s, trainer {r['trainer_tokens_per_s']:,.0f} tok/s "
        f"({r['model_tflops_per_s']:.1f} TFLOP/s, MFU {r['mfu']:.1%}), engine {r['engine_tokens_per_s']:,.0f} tok/s, "
        f"peak {r['peak_gb']:.2f} GB (sao plan {r['planned_peak_gb']:.2f} GB)"
    )


if __name__ == "__main__":
    main()
