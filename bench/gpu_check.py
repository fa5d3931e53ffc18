"""The GPU check (`make gpu-check`; docs/gpu.md, "The GPU check"): the trainer's loop in small, on one device, with
checks that can fail.

    random Qwen3-MoE (Qwen's vocabulary size) -> embedded engine samples a batch -> SAO step (K critic updates, the
    policy update) on one rank -> the new weights to the engine -> ...      at ZeRO-0 and at ZeRO-3, bf16

Each check prints and records in the JSON its figure, its threshold and pass/fail (`Thresholds`: each threshold and
why; `--threshold NAME=VALUE` replaces one). First the installed torch, transformers, accelerate, deepspeed and
pydantic against pyproject.toml's pins (a miss ends the run, naming both versions); per ZeRO stage, that the steps
train both models, that the DIS window drops no on-policy token, the peak device memory of a step against `sao plan`
and MFU against a floor; once, bf16 against fp32 log-probs of the sampled tokens and the engine's logged log-probs
against the trainer's. The JSON (`--out`) is rewritten atomically after the version check and after each stage
(`"finished"` false until the end; a stage that raises is its `"error"`). The exit status is non-zero when a judged
check fails, a stage raises or a version misses its pin.

It imports only torch, transformers, deepspeed, pydantic and the project's training, rollout and model modules, so a
bare GPU machine runs it with carried wheels (`--wheels` lists them). Without a GPU (`--cpu`; `make test` runs it)
a tiny model runs in bf16 on the host: every check runs; MFU and peak memory are reported, not judged (the host has
no bf16 peak and no device memory: its figures say the code runs, not how fast or how big).

    python -m bench.gpu_check [--cpu] [--out result.json] [--stages 0,3] [--threshold NAME=VALUE] [--accept-torch V]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
import time
import tomllib
import warnings
from dataclasses import asdict, dataclass, fields, replace
from importlib import metadata
from pathlib import Path

if "--cpu" in sys.argv:  # DeepSpeed reads it as it is imported; else default_accelerator(): cuda where torch sees a GPU
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import Version  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from components.config import load_config  # noqa: E402
from components.models import load_policy, token_logprobs  # noqa: E402
from components.rollout.embedded import EmbeddedEngine  # noqa: E402
from components.rollout.protocol import SamplingRequest  # noqa: E402
from components.training.engines.deepspeed_config import default_accelerator  # noqa: E402
from components.training.plan.layout import Workload, plan  # noqa: E402
from components.training.plan.memory import Zero  # noqa: E402
from components.training.plan.model import decoder_sizes, policy_and_critic  # noqa: E402
from components.training.rl.algorithms import settings_from  # noqa: E402
from components.training.rl.learner import Learner  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # DeepSpeed's ZeRO-3 calls
REPO = Path(__file__).resolve().parents[1]
H200_BF16_PEAK = 989e12
"""Dense bf16 FLOP/s of an H200 SXM (NVIDIA's figure, without sparsity): MFU's denominator."""
PINNED = ("torch", "transformers", "accelerate", "deepspeed", "pydantic")
"""The distributions the check imports, each checked against pyproject.toml's pin before anything runs."""
ON_THE_MACHINE = ("torch", "numpy")
"""Not carried: the GPU image's own CUDA torch (its wheel alone is GBs, a carried tree at most 64 MiB) and numpy."""
CARRY = "make gpu-wheels carries the pinned wheels; torch cannot be carried: --accept-torch VERSION; docs/gpu.md"
GPU_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64"}
"""The GPU machine's Python (Makefile GPU_PYTHON), for the markers of what is carried there (the rest as here)."""
LOGPROB_CHECKS = {  # `logprob_agreement`'s figures, each at most its threshold of the same name
    "bf16_vs_fp32_mean": "mean |bf16 - fp32|",
    "bf16_vs_fp32_max": "max |bf16 - fp32|",
    "engine_vs_trainer_mean": "mean |log ratio|, version 0",
}
BF16_STEP = 2.0**-8
"""bf16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of itself."""


@dataclass(frozen=True)
class Thresholds:
    """What each check allows. The log-prob bounds are the bf16 rounding of a trained model's logits (|z| ~ 10-30):
    z rounds by at most 2^-8 |z| (0.12 at 30), about half that on average, and log p_y = z_y - logsumexp(z) moves by
    e_y - sum_i p_i e_i, at most two such roundings. A random model's logits are smaller and sit well inside; beyond
    them is no rounding but a fault (a kernel, a cast, a weight that did not load)."""

    bf16_vs_fp32_mean: float = 30 * BF16_STEP / 2
    """Mean |bf16 - fp32| log-prob of the sampled tokens: the mean rounding of a logit of 30 (0.059)."""
    bf16_vs_fp32_max: float = 0.25
    """Largest |bf16 - fp32|: two roundings of a logit of 30 in opposite directions (2 x 30 x 2^-8 = 0.23)."""
    engine_vs_trainer_mean: float = 30 * BF16_STEP / 2
    """Mean |log ratio| of the engine's logged log-probs to the trainer's at version 0, both bf16: the same weights
    through other kernels (decode steps on a KV cache, a whole-sequence forward) round apart by as much, no more."""
    dis_dropped: float = 0.0
    """Fraction of action tokens the DIS window (reasoning: a ratio outside (0.7, 6.0)) drops while the engine
    serves the trainer's current weights: none, since dropping one takes |log ratio| > 0.36, beyond any rounding."""
    moved: float = 0.9
    """Fraction of a model's trainable elements (less the input embedding: a batch moves its tokens' rows only)
    changed over a stage. Adam's first step moves each weight with a gradient by the learning rate (3e-4 policy, 1e-3
    critic), which changes its bf16 copy for any |w| < 0.1 (init: ~0.02); the norms' 1.0s stay, and the weights whose
    later steps undo the first (4% of the host's tiny policy). A frozen LM head would leave 0.74 of the GPU policy."""
    memory_margin: float = 0.10
    """A step's allocated peak may exceed `sao plan`'s allocator peak by this fraction: what the plan leaves out
    (cuBLAS and attention workspaces, block rounding) is tens of MB against GBs; more is a term the plan misses."""
    mfu: float = 0.02
    """MFU floor at ZeRO 0-2. A step of the GPU size is 36.3 TFLOP (`step_flops`); 2% of 989 TFLOP/s is a step within
    1.8 s. Its GEMMs are small (16,384 x 1,024 x 1,024; the experts grouped, ~2,000 rows each), and fp32 AdamW over
    1.3B parameters and fp32 logits over 152K entries add memory-bound work: ~0.3 s (12%) at 40% of peak for the
    GEMMs. A sixth of that fails a step five times slower (a model or its optimizer on the host, a host copy per
    layer), not kernels slower than guessed; no GPU has measured it yet."""
    mfu_zero3: float = 0.01
    """MFU floor at ZeRO-3, half: on one GPU it adds a gather and a release (Python hooks) around each module's passes
    for no saving; 1% is a step within 3.7 s."""


@dataclass(frozen=True)
class Check:
    """One check's outcome, as the JSON holds it."""

    name: str
    measured: float | str | None
    threshold: float | str
    relation: str
    """"<=" or ">=" (measured against threshold), or "in" (a version in a specifier)."""
    ok: bool
    judged: bool
    """False: reported, not judged (MFU and memory on the host), and left out of the run's verdict."""
    why: str


def bound(name: str, measured: float | None, threshold: float, relation: str, why: str, judged: bool = True) -> Check:
    """`measured <= threshold` or `>=`; a missing or non-finite figure fails."""
    ok = measured is not None and math.isfinite(measured)
    ok = ok and (measured <= threshold if relation == "<=" else measured >= threshold)
    return Check(name, measured, threshold, relation, ok, judged, why)


class Report:
    """A run's figures and checks, each check printed as it comes; `save` rewrites `path` whole (atomically)."""

    def __init__(self, path: Path | None, **head) -> None:
        self.path = path
        self.data: dict = {**head, "stages": [], "logprobs": None, "checks": [], "error": None, "finished": False}

    def add(self, check: Check) -> None:
        self.data["checks"].append(asdict(check))
        verdict = ("pass" if check.ok else "FAIL") if check.judged else "reported"
        measured, threshold = (f"{x:.4g}" if isinstance(x, float) else x for x in (check.measured, check.threshold))
        print(f"  {verdict:8} {check.name}: {measured} {check.relation} {threshold}  ({check.why})", flush=True)

    @property
    def ok(self) -> bool:
        passed = all(c["ok"] for c in self.data["checks"] if c["judged"])
        return passed and self.data["finished"] and self.data["error"] is None

    def save(self) -> None:
        self.data["ok"] = self.ok
        if self.path is None:
            return
        temporary = self.path.with_name(self.path.name + ".tmp")  # then os.replace: no reader sees half a file
        temporary.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(temporary, self.path)


def version_checks(pyproject: Path, accept_torch: str | None = None) -> list[Check]:
    """Each of `PINNED` as imported here against `pyproject`'s pin. `accept_torch` passes one named torch release
    that misses the pin: a GPU image's CUDA build, which cannot be carried."""
    default_accelerator()  # before deepspeed is imported
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = {canonicalize_name(r.name): r for r in map(Requirement, dependencies)}
    checks = []
    for name in PINNED:
        if name not in pins:
            raise KeyError(f"gpu-check: {pyproject} pins no {name} in [project] dependencies")
        pin, installed = pins[name], importlib.import_module(name).__version__
        ok = pin.specifier.contains(str(installed), prereleases=True)
        why = f"pyproject.toml pins {pin}"
        if not ok and name == "torch" and accept_torch and Version(str(installed)).public == accept_torch:
            ok, why = True, f"{why}; --accept-torch {accept_torch}: the machine's CUDA build, which cannot be carried"
        checks.append(Check(f"version/{name}", str(installed), str(pin.specifier), "in", ok, True, why))
    return checks


def carried() -> dict[str, str]:
    """Each distribution the check needs on a GPU machine beyond `ON_THE_MACHINE`, at this environment's version:
    `PINNED`'s others and everything they require there (`make gpu-wheels` carries these as wheels)."""
    found: dict[str, str] = {}
    todo = [Requirement(name) for name in PINNED]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found or name in ON_THE_MACHINE or (req.marker and not req.marker.evaluate(GPU_PYTHON)):
            continue
        dist = metadata.distribution(name)  # PackageNotFoundError names it
        found[name] = dist.version
        todo += [Requirement(r) for r in dist.requires or []]
    return dict(sorted(found.items()))


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


def planned(config: Qwen3MoeConfig, size: Size, stage: int) -> tuple[float, float]:
    """`sao plan`'s bytes for this model, batch and stage on one GPU: the caching allocator's peak (what
    `max_memory_allocated` counts), and the whole peak (that plus a fragmentation reserve and NCCL's buffers)."""
    policy, critic = policy_and_critic(config, critic=True, frozen_attention=True)
    workload = Workload(
        policy=policy,
        critic=critic,
        decoder=decoder_sizes(config),
        zero=Zero(stage=stage, bf16=True),
        batch_size=size.rows,
        longest=size.prompt + size.new_tokens,
        budget=0,
        checkpointing=False,
    )
    fullest = plan(workload, 1, stage, "shared", capacity=math.inf).fullest
    return fullest.allocated, fullest.peak


def trainable_state(engine) -> dict[str, torch.Tensor]:
    """Host copies of `engine`'s trainable parameters, less the input embedding (a batch moves only its tokens' rows);
    under ZeRO-3 gathered."""
    named = engine.module.named_parameters()
    names = {n for n, p in named if p.requires_grad and not n.endswith("embed_tokens.weight")}
    return {n: t.to("cpu", copy=True) for part in engine.full_state() for n, t in part.items() if n in names}


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Fraction of the elements of `before` whose value differs in `after`."""
    changed = sum(int((after[n] != t).sum()) for n, t in before.items())
    return changed / max(1, sum(t.numel() for t in before.values()))


def logprob_agreement(model_dir: Path, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """bf16 log-probs of the batch's action tokens against fp32's, and the engine's logged ones (version 0, sampled in
    bf16, the training dtype) against the trainer's function's in bf16 (|log ratio|)."""
    act = batch["action_mask"].bool().to(device)
    values = {}
    for name, each in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_policy(model_dir, each).to(device)
        with torch.no_grad():
            values[name] = token_logprobs(model, batch["input_ids"].to(device))[act].float()
        del model
    gap = (values["bf16"] - values["fp32"]).abs()
    engine_gap = (values["bf16"] - batch["rollout_logprobs"].to(device)[act]).abs()
    return {
        "bf16_vs_fp32_max": float(gap.max()),
        "bf16_vs_fp32_mean": float(gap.mean()),
        "engine_vs_trainer_mean": float(engine_gap.mean()),
    }


def run_stage(model_dir: Path, config: Qwen3MoeConfig, size: Size, stage: int, device: torch.device, work: Path):
    """`size.steps` turns of the loop at ZeRO `stage` in bf16; the figures, and the first batch sampled."""
    ds_file = work / f"zero{stage}.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}))
    cfg = load_config(
        "tiny-cpu",
        ['train.backend="deepspeed"', f"train.zero_stage={stage}", f'train.deepspeed_config="{ds_file}"'],
    )
    cfg = replace(cfg, train=replace(cfg.train, batch_size=size.rows))
    cuda = device.type == "cuda"
    held = torch.cuda.memory_allocated() if cuda else 0  # the previous stage's leftovers, if any
    learner = Learner(cfg, model_dir, settings_from(cfg), threads=torch.get_num_threads())
    engine_model = load_policy(model_dir, learner.dtype).to(device)
    engine = EmbeddedEngine(engine_model, max_batch=size.rows)
    engine_bytes = sum(p.numel() * p.element_size() for p in engine_model.parameters())
    policy_before, critic_before = trainable_state(learner.policy), trainable_state(learner.critic)
    step_s, engine_tps, peaks, first, bad_losses, dropped = [], [], [], None, 0, 0.0
    for step in range(size.steps):
        batch, tokens_per_s = sample(engine, size, seed=step)
        first = first if first is not None else batch
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        metrics = learner.step(batch)
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - held - engine_bytes)
        if step:  # the first step allocates and warms up
            step_s.append(time.perf_counter() - began)
            engine_tps.append(tokens_per_s)
        bad_losses += not all(math.isfinite(float(metrics[k])) for k in ("policy/loss", "critic/loss"))
        dropped = max(dropped, float(metrics["dis/masked_frac_low"]) + float(metrics["dis/masked_frac_high"]))
        engine.load_weights(learner.weights(), step + 1)
        while engine.step():  # applies the new version
            pass
    seconds, (allocated, whole) = sum(step_s) / len(step_s), planned(config, size, stage)
    flops = step_flops(config, size, cfg.algo.critic_updates) / seconds
    result = {
        "zero_stage": stage,
        "dtype": str(learner.dtype).removeprefix("torch."),
        "step_s": seconds,
        "trainer_tokens_per_s": size.rows * (size.prompt + size.new_tokens) / seconds,
        "model_tflops_per_s": flops / 1e12,
        "mfu": flops / H200_BF16_PEAK,
        "engine_tokens_per_s": sum(engine_tps) / len(engine_tps),
        "peak_gb": max(peaks) / 1e9 if cuda else None,  # no device memory on the host
        "planned_allocated_gb": allocated / 1e9,
        "planned_peak_gb": whole / 1e9,
        "non_finite_or_skipped_steps": bad_losses + learner.policy.skipped_steps + learner.critic.skipped_steps,
        "dis_dropped_max": dropped,
        "policy_moved": moved(policy_before, trainable_state(learner.policy)),
        "critic_moved": moved(critic_before, trainable_state(learner.critic)),
    }
    del engine, engine_model, learner
    return result, first


def stage_checks(r: dict, t: Thresholds, on_gpu: bool) -> list[Check]:
    """The checks of one stage's figures `r` (`run_stage`); memory and MFU judged on a GPU only."""
    host, plan_gb = "" if on_gpu else "; on the host: reported, not judged", r["planned_allocated_gb"]
    rows = [
        ("bad_steps", r["non_finite_or_skipped_steps"], 0, "<=", "steps with a non-finite loss or a skipped update"),
        ("policy_moved", r["policy_moved"], t.moved, ">=", "fraction of the policy's weights changed"),
        ("critic_moved", r["critic_moved"], t.moved, ">=", "fraction of the critic's weights changed"),
        ("dis_dropped", r["dis_dropped_max"], t.dis_dropped, "<=", "tokens the DIS window drops, on-policy"),
    ]
    judged = [
        ("peak_gb", r["peak_gb"], plan_gb * (1 + t.memory_margin), "<=", f"sao plan's {plan_gb:.3g} GB + margin{host}"),
        ("mfu", r["mfu"], t.mfu_zero3 if r["zero_stage"] == 3 else t.mfu, ">=", f"of an H200's 989 TFLOP/s{host}"),
    ]
    name = f"zero{r['zero_stage']}/"
    return [bound(name + n, *rest) for n, *rest in rows] + [bound(name + n, *rest, on_gpu) for n, *rest in judged]


def thresholds_from(pairs: list[str]) -> Thresholds:
    """`Thresholds` with each NAME=VALUE of `pairs` replacing its default."""
    names = {f.name for f in fields(Thresholds)}
    changes = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in names:
            raise SystemExit(
                f"gpu-check: --threshold {pair}: no threshold {name!r} (one of {', '.join(sorted(names))})"
            )
        changes[name] = float(value)
    return replace(Thresholds(), **changes)


def main(argv: list[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the host and a tiny model, even where a GPU is present")
    parser.add_argument("--out", type=Path, help="write the figures and checks to this JSON file, as they come")
    parser.add_argument("--stages", default="0,3", help="ZeRO stages to run, in order (default 0,3)")
    parser.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE", help="replace a threshold")
    parser.add_argument("--accept-torch", metavar="VERSION", help="run on this torch although it misses the pin")
    parser.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml", help="the pins to check against")
    parser.add_argument("--wheels", action="store_true", help="print what `make gpu-wheels` carries, and exit")
    args = parser.parse_args(argv)
    if args.wheels:
        print("\n".join(f"{name}=={version}" for name, version in carried().items()))
        raise SystemExit(0)
    thresholds = thresholds_from(args.threshold)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    size = GPU if device.type == "cuda" else CPU
    where = torch.cuda.get_device_name() if device.type == "cuda" else "the host (a check that the script works)"
    print(f"gpu-check: torch {torch.__version__} on {where}; {size}", flush=True)
    report = Report(args.out, device=where, size=asdict(size), thresholds=asdict(thresholds))
    versions = version_checks(args.pyproject, args.accept_torch)
    for check in versions:
        report.add(check)
    if bad := [c for c in versions if not c.ok]:
        report.data["error"] = "; ".join(f"{c.name[8:]} {c.measured} is installed, {c.why}" for c in bad)
        report.save()
        raise SystemExit(f"gpu-check: {report.data['error']} ({CARRY})")
    with tempfile.TemporaryDirectory(prefix="sao-gpu-check-") as tmp:
        work = Path(tmp)
        config = build_model_dir(size, work / "policy", torch.bfloat16)
        for i, stage in enumerate(int(s) for s in args.stages.split(",")):
            try:
                result, batch = run_stage(work / "policy", config, size, stage, device, work)
                report.data["stages"].append(result)
                line = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
                print(f"ZeRO-{stage}: {line}", flush=True)
                for check in stage_checks(result, thresholds, device.type == "cuda"):
                    report.add(check)
                if i == 0:
                    figures = logprob_agreement(work / "policy", batch, device)
                    report.data["logprobs"] = figures
                    for name, why in LOGPROB_CHECKS.items():
                        report.add(bound(f"logprobs/{name}", figures[name], getattr(thresholds, name), "<=", why))
            except Exception as error:  # recorded, then raised on: the JSON says which stage failed and how
                report.data["error"] = f"ZeRO-{stage}: {type(error).__name__}: {error}"
                raise
            finally:
                report.save()
    report.data["finished"] = True
    report.save()
    failed = [c["name"] for c in report.data["checks"] if c["judged"] and not c["ok"]]
    print(f"gpu-check: {'every check passed' if report.ok else 'FAILED: ' + ', '.join(failed)}", flush=True)
    return report


if __name__ == "__main__":
    sys.exit(0 if main().ok else 1)
