"""Per-GPU memory of DeepSpeed training, by arithmetic: the planner behind `sao plan` (`planner.py` resolves the
numbers from a config; nothing here sees one). Everything is in bytes. What a GPU holds besides the models' tensors
(NCCL, the weight transfer, the allocator's fragmentation) is overheads.py's.

Model states, bytes per parameter (DeepSpeed 0.19, torch AdamW, bf16 on):

    weights         2  bf16 parameters                                     partitioned from ZeRO stage 3
    gradients       2  bf16 gradients                                      partitioned from stage 2
    optimizer      12  fp32 master weights 4 + Adam's two fp32 moments 8   partitioned from stage 1
    step gradients  4  the fp32 copy of the gradients the optimizer step reads: stage 0 `fused_optimizer.py`,
                       stages 1-2 the rank's partition (`stage_1_and_2.py` `step`), stage 3 one sub-group of
                       `sub_group_size` at a time (`stage3.py` `_prepare_fp32_grad_for_sub_group`)

That is 20 bytes per trainable parameter before partitioning. Frozen parameters (the critic's attention under
`sao`, components/models/freeze.py) hold weights only. With bf16 off (fp32, the CPU path) weights and gradients take
4 bytes; ZeRO stages 1-3 still keep their own fp32 partition (master) and its step copy, stage 0 neither (AdamW
steps the parameters themselves).

DeepSpeed's estimators (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`, no
offload) count the same 2 + 18/N at stage 2; at stage 3 they count 18/N, where stage3.py also keeps the bf16
gradient partition (`grad_partitions_flat_buffer`, 2/N): ours is 20/N, and tests/training/test_plan.py holds the
two to exactly that difference.

Optimizer offload (`zero_optimization.offload_optimizer.device` cpu or nvme, stages 1-3): the fp32 master weights,
Adam's moments and the fp32 gradients the step reads live on the host, where DeepSpeed steps them; at stage 3 so does
the bf16 gradient partition (stage3.py allocates `grad_partitions_flat_buffer` on the offload device). At stages 1-2
the planner still counts the gradients on the GPU (an upper bound). The host holds 12 + 4 bytes per trainable
parameter of the rank's partition, + 2 at stage 3.

ZeRO buffers: the gradient bucket (`reduce_bucket_size` elements, stages 1-3); at stage 3 also the gathered module's
full gradient before it is reduce-scattered. ZeRO-3's gathered parameters are a line of their own (`gather`):
DeepSpeed gathers a module's parameters all at once (`fetch_sub_module`, partitioned_param_coordinator.py), then
prefetches the next parameters in trace order, a whole parameter at a time, while fewer than
min(`stage3_max_live_parameters` - those available, `stage3_prefetch_bucket_size`) elements are in flight: the last
one it starts overshoots that budget by up to the largest single parameter. So at most the largest module, the
budget and the largest parameter are gathered at once (no prefetch when the largest module leaves no budget). In
Qwen3-30B-A3B the 128 experts of a layer are one module of two fused parameters (`gate_up_proj` 402.65M elements,
`down_proj` 201.33M): 603.98M + 50M + 402.65M elements, 2.11 GB in bf16. DeepSpeed's estimator counts 2 bytes x
largest layer for the gathered parameters and as much for their gradient.

Activations, bytes per token per decoder layer, counted from what autograd saves for the backward in transformers'
Qwen3-MoE layer (SDPA attention, grouped_mm experts), bf16. The method is Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4 (sbh(34 + 5as/h) per GPT layer); the terms are
this implementation's, not GPT's (h hidden, q = heads x head_dim, kv = kv_heads x head_dim, a heads, g kv heads,
E experts, k experts per token, f an expert's width):

    2 RMSNorms        2 x (4h fp32 copy + 4 rsqrt + 2h normalised + 2h output)                  16h + 8
    q/k norms         4q + 4a + 2q  +  4kv + 4g + 2kv                                            6q + 6kv + 4a + 4g
    attention         rotated q 2q, k and v repeated to the query heads 2q + 2q (transformers repeats
                      them when a padding mask is passed), output 2q (also o_proj's input), log-sum-exp 4a
    router            fp32 softmax 4E, top-k indices 8k, renormalisation 4k + 4
    experts, per routed token: input 2h, gate|up 4f, SiLU 2f, product 2f, output 2h, weight 2, indices 24
                                                                                                 k(4h + 8f + 26)
    and per layer, not per token, grouped_mm's int32 expert offsets, 4E.

Korthikanti's attention-score term (5as/h) is gone (SDPA keeps no scores), but a padded micro-batch's mask is not:
SDPA turns the boolean (rows, 1, len, len) mask into an additive bf16 one in every layer and keeps it, 2 bytes x
rows x len^2 per layer, and the boolean one lives through the pass. The planner takes the padded case (an upper
bound: one unpadded row needs no mask and keeps k and v unrepeated). Per model, besides the layers: the final norm
and the head's input (8h + 4 per token), the token ids (8), rotary cos/sin (4 x head_dim x len). With activation
checkpointing each layer keeps only its bf16 input (2h per token) and one layer is recomputed at a time. A dense
MLP (no experts) keeps 8f. Left out: gradients in flight during the backward, the loss's (B, T) tensors (tens of
bytes per token), the CUDA context and the libraries' workspaces: the free share a plan must keep
(layout.py `HEADROOM`) is for those. This is an estimate; the test checks the layer formula against what autograd
saves on CPU, not a GPU's peak.

The policy's LM head runs in chunks of 1024 positions (components/models/logprobs.py): four fp32 (chunk, vocab)
tensors at once (the statistics pass: logits, log-softmax, its exp and their product; the backward's recompute
holds about as many), 16 x chunk x vocab bytes.

What a GPU's models take (`gpu_peak`): the states of every model it holds, plus the larger of one model's backward
(activations, logits, buffers, gathered parameters) and one model's optimizer step (step gradients). Policy and
critic update one after the other (components/training/rl/algorithms.py), so their working sets never coexist.
layout.py adds overheads.py's lines to that for the GPU's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOGPROB_CHUNK = 1024
"""Positions per LM-head chunk (components/models/logprobs.py `token_logprobs`' chunk_size)."""


@dataclass(frozen=True)
class Params:
    """A model's parameter counts."""

    total: int
    """Every parameter."""
    trainable: int
    """Parameters with gradients and optimizer state (total less the frozen ones)."""
    largest_layer: int
    """Most parameters one module holds directly: what ZeRO-3 gathers at once (DeepSpeed's `model_to_params`)."""
    largest_param: int
    """Elements of the largest single parameter (Qwen3-MoE's fused `gate_up_proj`): what a ZeRO-3 prefetch may
    overshoot its bucket by, and the least a weight-transfer bucket holds."""


@dataclass(frozen=True)
class Decoder:
    """The sizes the activation arithmetic reads."""

    hidden: int
    """h: width of the residual stream."""
    layers: int
    """Decoder layers."""
    heads: int
    """a: query heads."""
    kv_heads: int
    """g: key/value heads."""
    head_dim: int
    """Width of a head."""
    experts: int
    """E: routed experts per layer; 0 for a dense MLP."""
    top_k: int
    """k: experts per token (1 for a dense MLP)."""
    intermediate: int
    """f: an expert's (or the dense MLP's) hidden width."""
    vocab: int
    """V: rows of the LM head."""


@dataclass(frozen=True)
class Zero:
    """A DeepSpeed config's memory-relevant settings (DeepSpeed's defaults where the file is silent)."""

    stage: int
    """ZeRO stage, 0-3."""
    bf16: bool
    """bf16 weights with fp32 master weights; False: fp32 throughout."""
    reduce_bucket: int = 500_000_000
    """`reduce_bucket_size`, elements."""
    prefetch_bucket: int = 50_000_000
    """`stage3_prefetch_bucket_size`, elements."""
    max_live: int = 1_000_000_000
    """`stage3_max_live_parameters`, elements."""
    sub_group: int = 1_000_000_000
    """`sub_group_size`, elements: the stage-3 optimizer steps its partition in groups of this size."""
    offload: bool = False
    """`offload_optimizer.device` is cpu or nvme: from stage 1 the optimizer's states and step live on the host."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage: must be 0-3, got {self.stage}")


@dataclass(frozen=True)
class ModelMemory:
    """One model's bytes on one GPU."""

    weights: float
    """Parameters (this rank's partition at stage 3)."""
    gradients: float
    """Low-precision gradients (partitioned from stage 2)."""
    optimizer: float
    """fp32 master weights and Adam moments (partitioned from stage 1)."""
    step_gradients: float
    """fp32 gradients while the optimizer steps (transient)."""
    activations: float
    """What one micro-batch's forward keeps for its backward (transient)."""
    logits: float
    """The LM head's chunk of logits and their gradients (transient; the policy only)."""
    buffers: float
    """ZeRO's gradient bucket and, at stage 3, the gathered module's gradient (during the backward)."""
    gather: float = 0.0
    """ZeRO-3's gathered parameters: the module being computed and the prefetched ones (during the backward)."""
    host: float = 0.0
    """What optimizer offload keeps in host memory instead (not the GPU's; reported beside it)."""

    @property
    def states(self) -> float:
        """What stays between steps: weights, gradients, optimizer."""
        return self.weights + self.gradients + self.optimizer

    @property
    def backward(self) -> float:
        """The working set of a forward and backward."""
        return self.activations + self.logits + self.buffers + self.gather

    @property
    def working(self) -> float:
        """The larger transient: the backward or the optimizer step."""
        return max(self.backward, self.step_gradients)


def gpu_peak(models: list[ModelMemory]) -> float:
    """Peak bytes the models of a GPU take, training one after the other: every model's states plus the largest
    working set (the GPU's own peak adds overheads.py's lines: layout.py `GpuMemory`)."""
    return sum(m.states for m in models) + max(m.working for m in models)


def model_states(params: Params, ranks: int, zero: Zero) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer, step gradients) on each of `ranks` GPUs (module docstring's table); what
    optimizer offload keeps on the host is 0 here (`host_states`)."""
    low = 2 if zero.bf16 else 4
    keeps_master = zero.bf16 or zero.stage >= 1
    weights = low * params.total / (ranks if zero.stage >= 3 else 1)
    gradients = low * params.trainable / (ranks if zero.stage >= 2 else 1)
    partition = params.trainable / (ranks if zero.stage >= 1 else 1)
    if offloads(zero):
        return weights, (0.0 if zero.stage == 3 else gradients), 0.0, 0.0
    optimizer = (12 if keeps_master else 8) * partition
    step = 4 * (min(partition, zero.sub_group) if zero.stage >= 3 else partition) if keeps_master else 0.0
    return weights, gradients, optimizer, step


def offloads(zero: Zero) -> bool:
    """Whether the optimizer steps on the host: offload asked for, at a stage that partitions it (1-3)."""
    return zero.offload and zero.stage >= 1


def host_states(params: Params, ranks: int, zero: Zero) -> float:
    """Bytes of each rank's states in host memory under optimizer offload (module docstring; 0 without): its
    partition's fp32 master weights and moments (12) and fp32 gradients (4), and at stage 3 its bf16 gradients."""
    if not offloads(zero):
        return 0.0
    per_param = 16 + ((2 if zero.bf16 else 4) if zero.stage == 3 else 0)
    return float(per_param * params.trainable / ranks)


def zero_buffers(largest_layer: int, zero: Zero) -> float:
    """ZeRO's buffers during the backward (module docstring): the gradient bucket from stage 1; at stage 3 also the
    gathered module's full gradient."""
    if zero.stage == 0:
        return 0.0
    low = 2 if zero.bf16 else 4
    return float(low * zero.reduce_bucket + (low * largest_layer if zero.stage == 3 else 0))


def gather_bytes(largest_layer: int, largest_param: int, zero: Zero) -> float:
    """ZeRO-3's gathered parameters at once (module docstring): the largest module, and the prefetch's budget
    (the bucket, within what `max_live` leaves beside that module) overshot by up to the largest parameter."""
    if zero.stage < 3:
        return 0.0
    budget = min(zero.prefetch_bucket, zero.max_live - largest_layer)
    prefetched = budget + largest_param if budget > 0 else 0
    return float((2 if zero.bf16 else 4) * (largest_layer + prefetched))


def layer_bytes_per_token(d: Decoder, padded: bool = True) -> int:
    """Bytes one decoder layer keeps per token for its backward in bf16 (module docstring's table). `padded`: a
    padding mask was passed, so k and v are kept repeated to the query heads."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    norms = 2 * (4 * h + 4 + 2 * h + 2 * h)
    qk_norms = 4 * q + 4 * d.heads + 2 * q + 4 * kv + 4 * d.kv_heads + 2 * kv
    keys_values = 2 * (2 * q if padded else 2 * kv)
    attention = 2 * q + keys_values + 2 * q + 4 * d.heads
    if d.experts:
        router = 4 * d.experts + 8 * d.top_k + 4 * d.top_k + 4
        mlp = router + d.top_k * (4 * h + 8 * d.intermediate + 26)
    else:
        mlp = 8 * d.intermediate
    return norms + qk_norms + attention + mlp


def padded_square(tokens: int, longest: int) -> int:
    """The most rows x len^2 a padded micro-batch of `tokens` padded tokens (rows x len) holds, rows at most `longest`
    long: padding needs two rows or more, so len <= tokens / 2."""
    return tokens * min(longest, tokens // 2)


def activation_bytes(d: Decoder, tokens: int, longest: int, checkpointing: bool, bf16: bool = True) -> float:
    """Bytes a model's forward of one micro-batch keeps for its backward (module docstring), at `tokens` padded
    tokens in rows of at most `longest`. In fp32 every activation is counted twice as wide (an approximation)."""
    square = padded_square(tokens, longest)
    layer = tokens * layer_bytes_per_token(d) + 2 * square + 4 * d.experts
    layers = (d.layers * tokens * 2 * d.hidden + layer) if checkpointing else d.layers * layer
    model = tokens * (8 * d.hidden + 4 + 8) + 4 * d.head_dim * min(longest, tokens) + square
    return float(layers + model) * (1 if bf16 else 2)


def logits_bytes(vocab: int, tokens: int) -> float:
    """The policy's LM-head chunk: four fp32 (chunk, vocab) tensors at once (module docstring)."""
    return float(16 * min(LOGPROB_CHUNK, tokens) * vocab)


def micro_batch_tokens(batch_size: int, ranks: int, longest: int, budget: int) -> int:
    """Padded tokens in a rank's largest micro-batch: its share of the batch (ceil(batch_size / ranks) rows of up to
    `longest` tokens) in one pass when `budget` is 0, else at most `budget`, and never less than one whole row."""
    shard = math.ceil(batch_size / ranks) * longest
    return shard if budget == 0 else min(shard, max(budget, longest))


def model_memory(
    params: Params,
    decoder: Decoder,
    ranks: int,
    zero: Zero,
    tokens: int,
    longest: int,
    checkpointing: bool,
    lm_head: bool,
) -> ModelMemory:
    """One model on each of `ranks` GPUs, training micro-batches of `tokens` padded tokens (rows of at most
    `longest`); `lm_head`: the policy, whose log-probs run through the chunked LM head."""
    weights, gradients, optimizer, step = model_states(params, ranks, zero)
    return ModelMemory(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        step_gradients=step,
        activations=activation_bytes(decoder, tokens, longest, checkpointing, zero.bf16),
        logits=logits_bytes(decoder.vocab, tokens) if lm_head else 0.0,
        buffers=zero_buffers(params.largest_layer, zero),
        gather=gather_bytes(params.largest_layer, params.largest_param, zero),
        host=host_states(params, ranks, zero),
    )
