"""The tables of the config tree, one frozen dataclass per section of a preset (`[model]`, `[train]`, ...), a
docstring under every field (a test enforces it) and the invariants checked at construction."""

from __future__ import annotations

import re
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from components.config.fields import (
    AdmissionRule,
    AlgoName,
    ChatFormatName,
    LatencyKind,
    MalformedCalls,
    RollbackTo,
    Seed,
    TokenizerName,
    TupleOf,
    check_location,
    is_http_url,
    parse_phases,
    require,
    section,
)
from components.config.reasoning_gym_uri import task_location

ENV_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""What `env.name` may be: it goes into metric keys and registered model names."""


@section("model")
class ModelConfig:
    path: str | None = None
    """Local Hugging Face model directory to start from; when set, the architecture fields below are ignored.
    Nothing is ever downloaded from a hub."""
    tokenizer: TokenizerName = "characters"
    """The tokenizer of a model built from config: `characters` (one token per character plus the chat markers)
    or `qwen3` (Qwen's real 151k BPE vocabulary with Qwen3's special tokens and a Qwen3-style chat template,
    built offline: components/models/qwen_vocab.py). Ignored when `path` is set (the directory's own is used)."""
    chat_format: ChatFormatName = "auto"
    """How prompts, tool calls and tool responses are written (components/chat): `auto` detects it from the
    model directory's tokenizer, `markers` is the project's own, `hermes` Qwen3/Qwen2.5's `<tool_call>` JSON."""
    hidden_size: PositiveInt = 128
    """Width of the residual stream."""
    num_layers: PositiveInt = 3
    """Decoder layers."""
    num_heads: PositiveInt = 2
    """Attention query heads."""
    num_kv_heads: PositiveInt = 1
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: PositiveInt = 64
    """Per-head width; >= 64 so that vLLM's CPU attention accepts the model."""
    num_experts: PositiveInt = 4
    """MoE experts per layer."""
    experts_per_token: PositiveInt = 2
    """Experts routed per token (top-k)."""
    moe_intermediate_size: PositiveInt = 128
    """Hidden width of each expert's MLP."""
    max_position_embeddings: PositiveInt = 512
    """Context length in tokens."""
    rope_theta: PositiveFloat = 10000.0
    """RoPE base frequency."""

    def __post_init__(self) -> None:
        require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}",
        )
        require(
            self.experts_per_token <= self.num_experts,
            "model.experts_per_token",
            f"must be <= num_experts={self.num_experts}, got {self.experts_per_token}",
        )


@section("task")
class TaskConfig:
    kinds: Annotated[TupleOf[Literal["affine", "two_step"]], Field(min_length=1)] = ("affine",)
    """Problem families of the synthetic tool-integrated task: `affine` is a*b+c with one tool call,
    `two_step` is (a*b+c)*d solved with two tool calls."""
    operand_max: Annotated[int, Field(ge=2)] = 99
    """Operands are drawn uniformly from [2, operand_max]."""
    train_size: PositiveInt = 20000
    """Teacher traces generated for SFT."""
    eval_size: PositiveInt = 200
    """Held-out problems (disjoint seed stream from training)."""
    seed: Seed = 0
    """Seed of the problem generator."""
    teacher_mental_max: NonNegativeInt = 700
    """The teacher answers without a tool call when a*b < this (a strong model's mental arithmetic, which
    the tiny student cannot imitate; the gap RL closes). 0: always use the tool."""
    teacher_mental_frac: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    """The share of the problems below `teacher_mental_max` the teacher answers in its head (fixed per question by
    a hash); it calls the tool on the rest, so the student sees tool calls and output copies on small problems
    too. 1: all of them."""
    max_turns: PositiveInt = 4
    """Model turns per episode (each turn ends at a tool call or the final answer)."""
    max_new_tokens: PositiveInt = 48
    """New tokens per model turn."""


@section("sft")
class SFTConfig:
    policy: str = ""
    """An HF model directory to use as the SFT policy instead of training one (no distill, no SFT): RL, value
    pretraining and evaluation start from it, e.g. a policy trained elsewhere for an environment without a
    teacher of its own (`sao train --policy DIR`). Empty: the SFT stage trains (or reuses) its own."""
    steps: PositiveInt = 1000
    """Optimizer steps."""
    batch_size: PositiveInt = 64
    """Traces per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to min_lr)."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: NonNegativeInt = 50
    """Linear warm-up steps (capped at `steps`)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    grad_clip: PositiveFloat = 1.0
    """Global gradient-norm clip."""
    seed: Seed = 0
    """Seed for model init and batch order."""
    log_every: PositiveInt = 100
    """Steps between progress lines."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """Engine of the SFT steps: plain torch AdamW in one process, or DeepSpeed on `train`'s settings (ZeRO stage,
    DeepSpeed file, micro-batches, activation checkpointing), data-parallel under torchrun: what a 30B policy needs.
    tiny-cpu keeps torch, whose results its figures pin."""

    def __post_init__(self) -> None:
        require(0 < self.min_lr <= self.lr, "sft.min_lr", f"must be in (0, lr={self.lr}], got {self.min_lr}")


@section("algo")
class AlgoConfig:
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Discount."""
    lam_critic: Annotated[float, Field(ge=0, le=1)] = 1.0
    """GAE lambda for the critic's targets (docs/design.md: decoupled lambdas)."""
    lam_policy: Annotated[float, Field(ge=0, le=1)] = 0.95
    """GAE lambda for the policy's advantages."""
    dis_preset: Literal["reasoning", "coding"] = "reasoning"
    """DIS window preset: reasoning (0.3, 5.0), coding (0.8, 3.0); eps_low/eps_high override it."""
    eps_low: PositiveFloat | None = None
    """DIS lower half-width; None takes the preset's."""
    eps_high: PositiveFloat | None = None
    """DIS upper half-width; None takes the preset's."""
    temperature: PositiveFloat = 1.0
    """Rollout sampling temperature; log-probs are log_softmax(logits / temperature)."""
    critic_updates: PositiveInt = 2
    """K: critic updates per policy update."""
    value_clip: PositiveFloat = 0.2
    """Clip range of the value loss."""
    normalize_advantages: bool = False
    """Whiten advantages per mini-batch (off for SAO)."""
    whiten_below_ev: float | None = None
    """Whiten the policy's advantages on a step whose updated critic explains less than this share of the returns'
    variance (explained variance against the lam_critic returns; the logged `critic/explained_variance` when
    lam_critic = 1), as Lego-RL's SAO port does while its critic is poor; None: only `normalize_advantages`
    decides. Logged as `policy/advantages_whitened`."""
    lam_length_alpha: NonNegativeFloat = 0.0
    """VAPO's length-adaptive lambda for the policy: each trajectory's lam = 1 - 1 / (alpha * l), l its action tokens,
    clamped to [0, 1] (alpha 0.05 in VAPO: long answers get lam near 1, less bias). 0: `lam_policy` for every row."""
    kl_anchor: NonNegativeFloat = 0.0
    """Weight of a KL anchor to the SFT policy in the policy loss: `kl_anchor * KL(policy || SFT)`, k3 on the sampled
    action tokens (docs/design.md section 2), so the policy keeps sampling what the SFT policy wrote (the style
    experiment's other styles after a preference flip). Each policy rank holds a frozen copy of the SFT policy and
    runs its forward on its rows every step; refused under ZeRO-3 (the copy is not partitioned). Logged as
    `policy/kl_anchor`. 0: off (the method as the paper states it)."""
    routing_replay: Literal["off", "r3"] = "off"
    """Rollout routing replay for an MoE policy: "r3" has the engine record each token's experts per layer into the
    trajectory and the policy's forward in training route those tokens to them (components/models/routing.py); the
    critic routes itself. The embedded engine records them; vLLM returns them in whole answers when started with
    `--enable-return-routed-experts` (vLLM 0.32: with VLLM_USE_V2_MODEL_RUNNER=1, which needs Triton, a GPU), so
    `rollout.backend = "http"` needs `rollout.server = "vllm"` and `rollout.update_mode = "drain"`, and a server that
    returns none is refused at start."""
    skip_observations: bool = True
    """Skip-observation GAE in RL (SAO's): a turn's last action token bootstraps from the next turn's first, over
    the tool's output. False steps GAE through every token between the first and last action token, observations
    included (the ablation of `sao experiment ablation`); value pretraining keeps skip-observation GAE."""

    @property
    def dis_window(self) -> tuple[float, float]:
        """(eps_low, eps_high) after applying the preset."""
        from components.algo import DIS_PRESETS  # algo imports torch; the config loads without it

        low, high = DIS_PRESETS[self.dis_preset]
        return (self.eps_low if self.eps_low is not None else low, self.eps_high if self.eps_high is not None else high)


@section("rollout")
class RolloutConfig:
    concurrency: PositiveInt = 8
    """Episodes in flight at once (C)."""
    max_total_tokens: PositiveInt = 512
    """Tokens per episode: prompt + actions + observations."""
    max_wall_s: PositiveFloat = 120.0
    """Wall-clock limit per episode."""
    tool_timeout_s: PositiveFloat = 5.0
    """Sandbox time limit per tool call."""
    tool_packages: TupleOf[str] = ("numpy", "sympy")
    """Top-level import names model-written code may import besides the standard library (read-only in the
    sandbox, with the distributions they require); each must be installed (docs/sandbox.md)."""
    sandbox_degraded: Literal["warn", "refuse"] = "warn"
    """When the sandbox cannot build its namespaces (not root, no CAP_SYS_ADMIN, unshare refused: docs/sandbox.md),
    `warn` runs model-written code degraded with a warning and a run-log line; `refuse` stops the run as its
    environment is set up, naming the reason, and first proves one sealed call. The GPU presets refuse."""
    latency: LatencyKind = "none"
    """Simulated extra tool latency (benchmarks): none, fixed or lognormal (heavy tail)."""
    latency_mean_s: NonNegativeFloat = 0.0
    """Mean of the simulated tool latency."""
    latency_sigma: NonNegativeFloat = 1.5
    """Lognormal sigma of the simulated tool latency."""
    max_batch: PositiveInt = 64
    """Sequences the embedded engine decodes together at most."""
    engine_dtype: Literal["float32", "bfloat16"] = "float32"
    """The embedded engine's compute dtype (`rollout.backend = "embedded"`; `sao engine serve --dtype` for servers).
    bfloat16 samples as a bf16 GPU engine does while the trainer stays in its own dtype: the sampler-trainer
    mismatch DIS exists for, measured as `rollout/mismatch_kl`. Log-probs are taken in float32 from its logits."""
    engine_threads: NonNegativeInt = 0
    """torch CPU threads of the embedded engine. 0: half the cores, in both modes (in async mode the trainer gets
    the rest: sharing cores between OpenMP teams stalls both; in sync mode the rest serve the tool calls)."""
    backend: Literal["embedded", "http"] = "embedded"
    """Where policies generate: the in-process engine (embedded) or external engine servers (http, `urls`)."""
    urls: TupleOf[str] = ()
    """Base URLs (http:// or https://) of the engine servers, which speak the engine protocol: `sao engine
    serve` or vLLM with the worker extension. Required for backend http, empty for embedded."""
    server: Literal["sao", "vllm"] = "sao"
    """Protocol flavour of those servers (the weight-update route and how versions are tagged)."""
    update_mode: Literal["continue", "drain"] = "continue"
    """What a weight update does to the requests in flight. "continue": they go on under the new weights, each token
    tagged with the version that sampled it (the embedded engine recomputes their KV cache between two decode steps;
    for vLLM the client streams, aborts its requests when an update comes and resumes each from its generated prefix
    once the load is done: components/rollout/gate.py). "drain": the update waits until they have finished, and
    admits nothing meanwhile: one version per request, rollout slots idle while the longest runs on."""
    publish_dir: str = ""
    """Directory the trainer writes each new policy version to, as an HF model directory, for the servers to
    load; it must be readable by the servers. Empty: `<home>/published`."""
    request_timeout_s: PositiveFloat = 300.0
    """Time limit of one request to an engine server."""
    request_retries: NonNegativeInt = 3
    """Retries of a failed request to an engine server (I/O errors only) before the episode fails."""
    engine_wait_s: NonNegativeFloat = 180.0
    """When every engine server is down, how long rollouts wait for one to come back (probing each) before the
    run stops with an error naming them; `--resume` continues once they are back. A restart costs time only."""
    weight_transfer: Literal["filesystem", "collective"] = "filesystem"
    """How each version reaches the servers (components/rollout/transports.py): `filesystem` writes an HF directory
    under `publish_dir` for them to read; `collective` broadcasts the tensors in buckets over a process group
    with each server (gloo on CPU, NCCL on GPU; `sao engine serve`, or vLLM through the worker extension, every
    worker of a tensor-parallel one receiving) and writes nothing."""
    transfer_senders: Literal["rank0", "all"] = "rank0"
    """Which trainer ranks send each version over the collective transfer: rank 0 alone (it gathers the whole policy
    and sends every bucket), or every rank that holds the policy, bucket i from rank i mod S over a pair group of
    its own with each server (components/rollout/senders.py): S links instead of one. Each rank then keeps its share
    of the last versions packed on the host (1/S of the policy each). The filesystem transfer ignores it."""
    transfer_bucket_mb: PositiveInt = 512
    """Size of one bucket of the collective transfer (tensors are packed up to it; a larger one goes alone)."""
    transfer_address: str = ""
    """The address the servers reach the trainer's process at for the collective transfer's rendezvous (its store
    and the gloo/NCCL connections). Empty: this host's address on the route to the first server (127.0.0.1 for
    servers on loopback, the pod's address in a cluster)."""
    transfer_timeout_s: PositiveFloat = 60.0
    """How long one collective transfer (or forming its group) may take before the server counts as failed."""
    transfer_fallback: bool = True
    """A collective transfer that fails twice (retried once on a new group) goes through the filesystem path
    instead, counted in `rollout/transfer_fallbacks`; the servers must then read `publish_dir`."""
    probe_every: NonNegativeInt = 1
    """After every N-th version (0: never), each server's log-probs of a fixed sample are checked against the
    trainer's (components/rollout/probe.py); a server off by more than `probe_tolerance` leaves the pool."""
    probe_tolerance: PositiveFloat | None = None
    """Largest median |log-prob| difference over the probe's tokens that the probe accepts. None: from the dtype the
    weights are served in (components/rollout/probe.py, `TOLERANCE`: 1e-4 at fp32, 0.05 at bf16)."""
    publish_overlap: bool = False
    """HTTP servers: the trainer goes on to its next step once a version is staged (a host copy), while the transfer
    runs; the step after waits for it. Rollouts sample the previous version meanwhile (their tokens say so). Sync
    mode (`train.sync`) always waits before generating a batch."""

    def __post_init__(self) -> None:
        if self.backend == "http":
            require(len(self.urls) > 0, "rollout.urls", "needs at least one server URL for backend='http'")
            for url in self.urls:
                require(is_http_url(url), "rollout.urls", f"must start with http:// or https://, got {url!r}")
        else:
            require(not self.urls, "rollout.urls", f"must be empty for backend='embedded', got {list(self.urls)}")
            # the embedded engine loads the trainer's tensors in memory: nothing of these applies to it
            require(
                self.weight_transfer == "filesystem",
                "rollout.weight_transfer",
                "applies to backend='http' servers only (the embedded engine loads the weights in memory)",
            )
            require(
                not self.publish_overlap,
                "rollout.publish_overlap",
                "applies to backend='http' servers only (the embedded engine loads between two decode steps)",
            )


@section("train")
class TrainConfig:
    algo: AlgoName = "sao"
    """Algorithm (one loop for all; see components/training/rl/algorithms.py)."""
    batch_size: PositiveInt = 16
    """Trajectories per policy update (whole groups for GRPO)."""
    max_steps: PositiveInt = 200
    """Policy updates."""
    max_staleness: NonNegativeInt = 2
    """Admission control bound, in policy versions (see `admission`)."""
    admission: AdmissionRule = "capacity"
    """capacity: at most (version + max_staleness + 1) x batch_size episodes ever started (AReaL); oldest: no
    new episode while the oldest in-flight one started more than max_staleness versions ago (one straggler
    stalls every start). See components/training/rl/buffer.py."""
    sync: bool = False
    """Synchronous mode: generate a batch, wait for all of it, train (same code, for async-vs-sync)."""
    sync_lag: NonNegativeInt = 0
    """Synchronous mode only: roll out with the policy this many versions old, a reproducible stand-in for
    asynchronous policy lag (the learning-curve regression test uses it). Not carried across a resume."""
    group_size: PositiveInt = 8
    """GRPO group size N (grpo, grpo-dis)."""
    group_filter: Literal["off", "drop-uniform"] = "off"
    """Grouped algorithms (GRPO): `drop-uniform` drops a finished group whose rewards are all equal (its advantages
    are exactly 0: no signal) and starts other prompts in its place, as DAPO's dynamic sampling does, so that every
    step updates the policy; counted in `rollout/groups_dropped`. `off`: every group trains."""
    policy_lr: PositiveFloat = 3e-4
    """Policy AdamW learning rate (tiny-cpu: 1e-4 barely moved in 100 steps, 2e-3 collapsed)."""
    critic_lr: PositiveFloat = 1e-3
    """Critic AdamW learning rate (larger than the policy's, docs/design.md section 2)."""
    weight_decay: float = 0.0
    """AdamW weight decay for both models."""
    adam_beta2: Annotated[float, Field(gt=0, lt=1)] = 0.95
    """AdamW second-moment decay for both models (tiny-cpu: 0.999 collapsed 2 of 3 runs, 0.95 1 of 5)."""
    adam_eps: PositiveFloat = 1e-8
    """AdamW epsilon of RL's policy and critic (SFT and value pretraining keep 1e-8). A step is about lr per parameter
    whatever the gradient's size once that size is well above epsilon; a larger epsilon makes a parameter whose
    gradient stays below it move in proportion to the gradient instead. On tiny-cpu 1e-5 stopped one catastrophic
    update in a replay, but 6 runs with it ended lower than without (docs/stability.md), so every preset keeps 1e-8.
    Scale it with the model: a 30B model's per-parameter gradients are orders of magnitude smaller."""
    grad_clip: float = 1.0
    """Global gradient-norm clip for both models."""
    critic_grad_clip: PositiveFloat | None = None
    """The critic's own gradient-norm clip (RL and value pretraining); None: `grad_clip`. Lego-RL's SAO port measured
    critic gradient norms of 7-68 on a 35B MoE and clipped at 10 instead of 1."""
    critic_warmup_steps: NonNegativeInt = 0
    """The first steps update the critic only (its K updates; the policy's weights and version stay), as the public
    SAO ports warm up on top of a pretrained critic. Needs an algorithm with a critic."""
    max_token_lag: NonNegativeInt | None = None
    """Evict a finished trajectory whose oldest sampled token is more than this many versions behind the policy
    when its batch is formed (unirl's rule); its admission slot is given back and another episode starts. Counted
    in `rollout/evicted`. None: every finished trajectory trains (eviction biases training toward short, fast
    rollouts: the buffer's docstring). Single-rollout algorithms only."""
    warmup_steps: NonNegativeInt = 0
    """Linear learning-rate warm-up of both models over the first steps (0: none)."""
    min_lr_ratio: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Cosine decay of both learning rates to this fraction of their peak at `max_steps` (1.0: constant)."""
    collapse_guard: Literal["rollback", "stop", "off"] = "rollback"
    """When the collapse rule fires (components/training/rl/stability.py): roll back to the newest checkpoint
    before the collapse and continue with the learning rates scaled by `rollback_lr_scale` (rollback), roll
    back and end the run there (stop), or only log it (off)."""
    rollback_to: RollbackTo = "onset"
    """Which checkpoint a rollback returns to: the newest from before the collapse's onset (the smoothed reward's
    first step below half its peak, less its window), or (`near-peak`) from before the smoothed reward last left
    0.9 x its peak; for a slow drift the onset's checkpoint is already far below the peak
    (components/training/rl/stability.py)."""
    rollback_lr_scale: Annotated[float, Field(gt=0, le=1)] = 0.5
    """Factor on both learning rates after each rollback."""
    max_rollbacks: NonNegativeInt = 2
    """Rollbacks allowed before the guard stops the run instead."""
    backend: Literal["torch", "deepspeed"] = "deepspeed"
    """Training engine: DeepSpeed (ZeRO, CPU fp32 / GPU bf16) or plain torch AdamW."""
    zero_stage: Annotated[int, Field(ge=0, le=3)] = 0
    """DeepSpeed ZeRO stage (0-3). Stage 3 partitions the parameters too: log-probs and values run through the
    modules' own calls, checkpoints are DeepSpeed's per-rank files, and published weights are gathered in buckets."""
    micro_batch_tokens: NonNegativeInt = 0
    """Padded tokens (rows x longest row) per micro-batch on each rank: a rank's rows go through forward and backward
    in micro-batches within this budget, their gradients accumulated into one optimizer step whose result is the
    whole batch's (token-weighted). 0: a rank's rows in one pass."""
    critic_ranks: NonNegativeInt = 0
    """Ranks of their own for the critic, the last of the torchrun world (the policy on the others), each model
    data-parallel over its own ranks (components/training/rl/placement.py); 0: both models on every rank. `sao plan`
    prices either."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (policy and critic):
    about a third more compute for activation memory that no longer grows with the layers."""
    deepspeed_config: str = ""
    """DeepSpeed JSON file merged over the built-in config (`infra/deepspeed/*.json`; a relative path is taken
    from the working directory): its keys win (`zero_optimization`, whose stage replaces `zero_stage`, `bf16`,
    ...); lr, betas, weight decay and gradient clipping stay the fields above unless it sets them. Empty: the
    built-in config. Backend deepspeed only."""
    checkpoint_every: NonNegativeInt = 10
    """Steps between checkpoints (0: only at the end)."""
    checkpoint_failures: NonNegativeInt = 2
    """Checkpoints in a row that may fail to reach the store (after its own retries: an outage longer than about
    half a minute) while training goes on; one more stops the run. A process's first checkpoint and a run's
    last must be stored: failing those is a misconfigured store, not an outage."""
    keep_checkpoints: NonNegativeInt = 0
    """How many of the newest complete checkpoints the store keeps (0: all). Once a checkpoint is complete the older
    ones beyond this many are deleted (each loses its completion marker first), on the upload's thread: a resume and
    the collapse guard's roll back use the newest, `sao train --rollback-to` and an evaluation can reach only the
    kept ones. A checkpoint under ZeRO with Adam is 14 bytes a parameter (bf16 weights, fp32 master weights and two
    moments: 420 GB at 30B): without a bound a run of 1000 steps that saves every 20 stores 50 of them."""
    task_seed: Seed = 1
    """Seed of the RL prompt stream (disjoint from SFT's and from the held-out set)."""
    threads: NonNegativeInt = 0
    """torch CPU threads of the trainer. 0: the cores the engine does not use in async mode, all in sync mode."""
    record_batches: bool = True
    """Write every step's batch (its trajectories in the order trained, the version it started from, its learning-rate
    factor and metrics) under `<home>/batches/`, so that `sao train --replay` can repeat the run's updates exactly,
    without the engine's timing (components/training/rl/replay.py). About 16 KB per step on the tiny preset."""
    critic_path: str = ""
    """HF directory of a pretrained critic (`ValueModel.save`, e.g. written by value pretraining); empty: start
    the critic from the SFT policy with a fresh head. Ignored by algorithms without a critic."""

    def __post_init__(self) -> None:
        require(
            "://" not in self.critic_path,
            "train.critic_path",
            f"must be a local directory (fetch remote artifacts first), got {self.critic_path!r}",
        )
        require(
            not self.deepspeed_config or self.backend == "deepspeed",
            "train.deepspeed_config",
            f"needs train.backend = 'deepspeed', got {self.backend!r}",
        )
        require(self.sync or not self.sync_lag, "train.sync_lag", "needs train.sync = true (async runs lag anyway)")
        require(
            not self.critic_warmup_steps or self.algo not in ("sao-running-mean", "grpo", "grpo-dis"),
            "train.critic_warmup_steps",
            f"needs an algorithm with a critic, got train.algo = {self.algo!r}",
        )
        require(
            self.group_filter == "off" or self.algo in ("grpo", "grpo-dis"),
            "train.group_filter",
            f"filters GRPO's groups; {self.algo!r} samples each prompt once",
        )
        require(
            self.max_token_lag is None or self.algo not in ("grpo", "grpo-dis"),
            "train.max_token_lag",
            f"evicts single rollouts; {self.algo!r} trains whole groups",
        )
        if self.algo in ("grpo", "grpo-dis"):
            require(
                self.batch_size % self.group_size == 0,
                "train.batch_size",
                f"must be a multiple of group_size={self.group_size} for {self.algo}, got {self.batch_size}",
            )


@section("value_pretrain")
class ValuePretrainConfig:
    episodes: PositiveInt = 512
    """Rollouts of the SFT policy (one per prompt) to pretrain the critic on, held-out part included. The
    defaults fit tiny-cpu: ~33 s on 2 cores (15 s of rollouts, 7 epochs), held-out explained variance -0.08
    (cold) -> 0.87 (best epoch 5)."""
    held_out_frac: Annotated[float, Field(gt=0, lt=1)] = 0.25
    """Fraction of the prompts held out to measure explained variance (early stopping and the report)."""
    max_epochs: PositiveInt = 12
    """Passes over the training part at most."""
    patience: PositiveInt = 2
    """Stop after this many epochs without a better held-out explained variance; the best epoch is kept."""
    batch_size: PositiveInt = 16
    """Trajectories per critic update."""
    lr: NonNegativeFloat = 0.0
    """AdamW learning rate of the pretraining; 0: `train.critic_lr`."""
    seed: Seed = 0
    """Seed of the held-out split, the minibatch order, the value head's init and the rollout sampling."""
    backend: Literal["torch", "deepspeed"] = "torch"
    """Engine of the critic's pretraining: plain torch AdamW in one process, or DeepSpeed on `train`'s settings,
    data-parallel under torchrun (as `sft.backend`)."""
    warm_start: bool = True
    """The pipeline and `sao sweep` start RL's critic from the pretrained one (as `train.critic_path`); false starts
    it cold (the SFT decoder with a fresh head). With a cold critic a third of tiny-cpu's runs ended low
    (docs/stability.md, "Why a third of the runs ended low, and the fix")."""

    def __post_init__(self) -> None:
        held = self.held_out_episodes
        require(
            1 <= held < self.episodes,
            "value_pretrain.held_out_frac",
            f"holds out {held} of episodes={self.episodes}; need at least one held-out and one training "
            f"episode, got {self.held_out_frac}",
        )

    @property
    def held_out_episodes(self) -> int:
        """Prompts in the held-out part: `round(episodes * held_out_frac)`."""
        return round(self.episodes * self.held_out_frac)


@section("tracking")
class TrackingConfig:
    backend: Literal["mlflow", "disk"] = "mlflow"
    """Where metrics go besides the JSON lines under the home: MLflow, or the JSON lines only."""
    uri: str = ""
    """MLflow tracking URI. Empty: `$MLFLOW_TRACKING_URI` if set, else `sqlite:///<home>/mlflow.db`."""
    experiment: str = "sao"
    """MLflow experiment name."""
    prometheus_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Port of the trainer's Prometheus exporter (`/metrics`, docs/metrics.md), on rank 0 only. 0:
    `$SAO_PROMETHEUS_PORT` if set, else no exporter."""
    prometheus_addr: str = ""
    """Address the exporter listens on (`0.0.0.0` for a Prometheus on another host or in a container). Empty:
    `$SAO_PROMETHEUS_ADDR` if set, else 127.0.0.1."""

    def __post_init__(self) -> None:
        require(bool(self.experiment.strip()), "tracking.experiment", "must not be empty")


@section("env")
class EnvConfig:
    name: str = ""
    """The environment every job uses (SFT data, RL rollouts, evaluation), by its name in the `sao.environments`
    entry-point group: the built-in tir_math, coding and style, or any an installed package registers. With
    `entrypoint` set it only labels the run (metric keys `eval/{name}/...`, registered model names). Empty: the
    entry point's module name (its last dotted part), else tir_math."""
    entrypoint: str = ""
    """`package.module:factory`: the environment factory to call, imported as is (a module on PYTHONPATH is
    enough), instead of looking `name` up. `factory(options)` or `factory(options, context)` returns an
    `EnvSetup` (components/contracts/environment.py; docs/environments.md)."""
    options: dict[str, Any] = field(default_factory=dict)
    """`[env.options]`: a free table handed to the factory as its `options` (`--set env.options.size=100`)."""
    tasks: str = ""
    """Training problem set: empty = the environment's built-in set; else a local JSONL/Parquet path, an
    `s3://bucket/key` URI, or a reasoning-gym dataset with its options,
    `reasoning-gym:<dataset>?size=2000&seed=3&<option>=<value>` (components/config/reasoning_gym_uri.py; values
    are TOML; graded by the dataset's `score_answer` in tir_math)."""
    eval_tasks: str = ""
    """Held-out problem set, same forms; empty = the environment's built-in held-out set, or beside a reasoning-gym
    `tasks` the same dataset and options held out (`split=eval`: never a training question)."""
    judge: str = "lexical"
    """Style only: `lexical` (embedded, deterministic: only the preferred style scores above 0), `graded` (the same
    lexicon with partial credit, as an LLM judge rates: neutral text 0.1, other styles' markers take credit away;
    components/envs/style.py) or the base URL (http:// or https://) of an OpenAI-compatible chat endpoint that
    scores style."""
    judge_model: str = ""
    """Model name sent to the judge endpoint (required when `judge` is a URL)."""
    malformed_calls: MalformedCalls = "observe"
    """A tool call that cannot be parsed or does not fit the tools: `observe` answers it with an error the model
    sees next, `end` ends the episode with reward 0 (finish reason `malformed_call`). Counted either way."""
    preference_schedule: str = ""
    """Style only: comma-separated `style:steps` phases, e.g. `cute:100,chuunibyou:100,classical:100`; the
    schedule repeats after its last phase. Empty: cute throughout."""

    def __post_init__(self) -> None:
        if self.entrypoint:
            module, sep, attr = self.entrypoint.partition(":")
            require(
                bool(sep and module.strip() and attr.strip()) and " " not in self.entrypoint,
                "env.entrypoint",
                f"expected 'package.module:factory', got {self.entrypoint!r}",
            )
        if not self.name:  # frozen: set once, here, before anything reads it
            object.__setattr__(self, "name", self.entrypoint.partition(":")[0].rsplit(".", 1)[-1] or "tir_math")
        require(
            bool(ENV_NAME.fullmatch(self.name)),
            "env.name",
            f"must be letters, digits, '_', '-' or '.' (it names metrics and models), got {self.name!r}",
        )
        object.__setattr__(self, "tasks", task_location(self.tasks, "env.tasks", "train"))
        object.__setattr__(self, "eval_tasks", task_location(self.eval_tasks, "env.eval_tasks", "eval", self.tasks))
        judge_url = is_http_url(self.judge)
        require(
            self.judge in ("lexical", "graded") or judge_url,
            "env.judge",
            f"must be 'lexical', 'graded' or an http:// or https:// base URL, got {self.judge!r}",
        )
        require(
            not judge_url or self.name == "style",
            "env.judge",
            f"a URL judge is for env.name='style' only, got name={self.name!r}",
        )
        require(
            not judge_url or bool(self.judge_model.strip()),
            "env.judge_model",
            f"required when env.judge is a URL ({self.judge})",
        )
        require(
            not self.preference_schedule or self.name == "style",
            "env.preference_schedule",
            f"is for env.name='style' only, got name={self.name!r}",
        )
        parse_phases(self.preference_schedule)

    @property
    def preference_phases(self) -> tuple[tuple[str, int], ...]:
        """The schedule as ((style, steps), ...), never empty: an empty schedule is (("cute", 1),)."""
        return parse_phases(self.preference_schedule)


@section("distill")
class DistillConfig:
    teacher: str = "programmatic"
    """Who writes the SFT traces: `programmatic` (the environment's built-in teacher, the embedded default) or
    the base URL (http:// or https://, ending in /v1) of an OpenAI-compatible chat endpoint with tool calling,
    e.g. GPT-OSS-120B behind vLLM. An endpoint teacher solves the environment's training problems (tir_math)."""
    model: str = ""
    """Model name sent to the teacher endpoint (required when `teacher` is a URL)."""
    temperature: NonNegativeFloat = 0.0
    """Teacher sampling temperature."""
    max_tokens: PositiveInt = 4096
    """Teacher completion tokens per turn."""
    max_turns: PositiveInt = 8
    """Assistant turns per problem before the conversation is given up (a rejected trace)."""
    concurrency: PositiveInt = 16
    """Problems in flight at the teacher endpoint."""
    timeout_s: PositiveFloat = 300.0
    """Per-request timeout at the teacher endpoint."""
    retries: NonNegativeInt = 3
    """Retries of a request after a connection error, a timeout, 429 or 5xx (with backoff)."""

    def __post_init__(self) -> None:
        url = is_http_url(self.teacher)
        require(
            self.teacher == "programmatic" or url,
            "distill.teacher",
            f"must be 'programmatic' or an http:// or https:// base URL, got {self.teacher!r}",
        )
        require(
            not url or bool(self.model.strip()),
            "distill.model",
            f"required when distill.teacher is a URL ({self.teacher})",
        )


@section("store")
class StoreConfig:
    uri: str = ""
    """Where checkpoints, model directories and datasets are kept: empty = `$SAO_STORE_URI` if set, else the
    local run home; else a local path or `s3://bucket/prefix`."""

    attempts: PositiveInt = 6
    """s3:// stores: tries of each object operation (a file, the manifest, the marker, a listing) before the
    error; jittered backoff from `backoff_s` doubling to 30 s between them, so 6 ride out about half a minute."""
    backoff_s: PositiveFloat = 1.0
    """s3:// stores: the first backoff of `attempts`."""

    def __post_init__(self) -> None:
        check_location(self.uri, "store.uri", "prefix")

    def options(self, uri: str) -> dict:
        """`open_store`'s options for `uri` (the retry settings apply to s3:// stores only)."""
        return {"attempts": self.attempts, "backoff_s": self.backoff_s} if uri.startswith("s3://") else {}
