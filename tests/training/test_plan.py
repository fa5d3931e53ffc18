"""The GPU memory planner (`sao plan`, components/training/plan): model states per ZeRO stage by hand and against
DeepSpeed's own estimators, the activation formula against what autograd saves, ZeRO-3's gathered parameters, what a
GPU holds besides its models (NCCL, the weight transfer, fragmentation), the placements, the 30B presets' headroom,
and the CLI."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from components.cli import main
from components.config import load_config
from components.models import ValueModel
from components.training.engines.deepspeed_config import default_accelerator
from components.training.plan.layout import HEADROOM, GpuMemory, Workload, cheapest, plan, plans
from components.training.plan.memory import (
    Decoder,
    ModelMemory,
    Params,
    Zero,
    activation_bytes,
    gather_bytes,
    gpu_peak,
    host_states,
    layer_bytes_per_token,
    logits_bytes,
    micro_batch_tokens,
    model_states,
    padded_square,
    zero_buffers,
)
from components.training.plan.model import hf_config, policy_and_critic
from components.training.plan.overheads import Runtime, expandable_segments, nccl_group_bytes, transfer_bytes
from components.training.plan.planner import workload

# A tiny model: 1000 parameters, 200 of them frozen, the largest module 100, its largest parameter 60; 4 GPUs.
TINY = Params(total=1000, trainable=800, largest_layer=100, largest_param=60)
GIB = 2**30
MIB = 2**20


@pytest.fixture(autouse=True)
def _allocator_unset(monkeypatch):
    """`sao plan` reads the allocator's settings from its environment: none here, whatever the shell has."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


@pytest.mark.parametrize(
    "stage,expected",
    [
        # (weights, gradients, optimizer, step gradients), bf16: 2 / 2 / 12 / 4 bytes per parameter; the frozen
        # 200 hold weights only, so gradients, optimizer and step count the 800 trainable.
        (0, (2 * 1000, 2 * 800, 12 * 800, 4 * 800)),  # nothing partitioned
        (1, (2 * 1000, 2 * 800, 12 * 800 / 4, 4 * 800 / 4)),  # optimizer (and its fp32 step copy) over 4
        (2, (2 * 1000, 2 * 800 / 4, 12 * 800 / 4, 4 * 800 / 4)),  # + gradients
        (3, (2 * 1000 / 4, 2 * 800 / 4, 12 * 800 / 4, 4 * 150)),  # + weights; the step copy is one sub-group (150)
    ],
)
def test_model_states_partition_one_more_thing_per_stage(stage, expected):
    zero = Zero(stage=stage, bf16=True, sub_group=150)
    assert model_states(TINY, 4, zero) == expected


def test_fp32_keeps_no_master_copy_at_stage_0_and_one_from_stage_1():
    # fp32 weights and gradients take 4 bytes; stage 0 is plain AdamW (8: two moments, no copy, no step copy);
    # ZeRO-1 keeps its fp32 partition (4 + 8 = 12 over 4 GPUs) and its step copy (4 x 800 / 4).
    assert model_states(TINY, 4, Zero(stage=0, bf16=False)) == (4000, 3200, 6400, 0.0)
    assert model_states(TINY, 4, Zero(stage=1, bf16=False)) == (4000, 3200, 2400, 800)


def test_zero_buffers_bucket_from_stage_1_and_the_gathered_layers_gradient_at_stage_3():
    zero = dict(bf16=True, reduce_bucket=10, prefetch_bucket=20, max_live=1000)
    assert zero_buffers(100, Zero(stage=0, **zero)) == 0
    assert zero_buffers(100, Zero(stage=2, **zero)) == 2 * 10  # the bf16 gradient bucket
    assert zero_buffers(100, Zero(stage=3, **zero)) == 2 * 10 + 2 * 100  # + the gathered layer's bf16 gradient


def test_zero3_gathers_the_largest_module_and_a_prefetch_that_overshoots_by_one_parameter():
    """DeepSpeed's prefetch loop (partitioned_param_coordinator.py) starts whole parameters while fewer than
    min(bucket, max_live - available) elements are in flight, so it may start one more, up to the largest parameter
    (60 of TINY's module of 100). Bucket 20, max_live 1000: 100 + 20 + 60 = 180 elements, 360 bytes in bf16."""
    zero = dict(bf16=True, prefetch_bucket=20, max_live=1000)
    assert gather_bytes(100, 60, Zero(stage=2, **zero)) == 0  # stages 0-2 keep whole weights: nothing to gather
    assert gather_bytes(100, 60, Zero(stage=3, **zero)) == 2 * (100 + 20 + 60) == 360
    # max_live 110 leaves a budget of 10 beside the module, still overshot by a whole parameter: 100 + 10 + 60
    assert gather_bytes(100, 60, Zero(stage=3, **{**zero, "max_live": 110})) == 2 * 170
    # max_live at or below the module leaves none: the module alone, never less
    assert gather_bytes(100, 60, Zero(stage=3, **{**zero, "max_live": 50})) == 2 * 100
    assert gather_bytes(100, 60, Zero(stage=3, **{**zero, "bf16": False})) == 4 * 180  # fp32


ON_GPUS = 'train.deepspeed_config="infra/deepspeed/zero3-bf16.json"'
"""The 30B presets with their optimizers on the GPUs (the file without offload_optimizer)."""


def test_the_30b_gathers_its_fused_experts_and_the_next_layers_experts():
    """The experts module is the 30B's largest (603,979,776: gate_up_proj 128 x 1536 x 2048 = 402,653,184 and
    down_proj 128 x 2048 x 768 = 201,326,592), its gate_up_proj the largest parameter (805 MB in bf16).
    infra/deepspeed/zero3-bf16.json (prefetch bucket 50M, max_live 1e9): 2 x (603,979,776 + 50,000,000 + 402,653,184)
    bytes. The presets' zero3-bf16-offload.json prefetches the next layer's whole experts module (a bucket of
    603,979,776, max_live 2e9): 2 x (603,979,776 + 603,979,776 + 402,653,184)."""
    w = workload(load_config("qwen3-30b-a3b", [ON_GPUS]), {})
    assert (w.zero.stage, w.zero.prefetch_bucket, w.zero.max_live) == (3, 50_000_000, 1_000_000_000)
    assert w.policy.largest_param == w.critic.largest_param == 128 * 1536 * 2048 == 402_653_184
    assert gather_bytes(w.policy.largest_layer, w.policy.largest_param, w.zero) == 2_113_265_920
    shipped = workload(load_config("qwen3-30b-a3b"), {})
    assert (shipped.zero.prefetch_bucket, shipped.zero.max_live) == (603_979_776, 2_000_000_000)
    assert gather_bytes(shipped.policy.largest_layer, shipped.policy.largest_param, shipped.zero) == 2 * (
        603_979_776 + 603_979_776 + 402_653_184
    )


def test_optimizer_offload_moves_the_optimizer_and_at_stage_3_the_gradients_to_the_host():
    """TINY over 4 GPUs, bf16, offloaded: the optimizer (12) and its fp32 step gradients (4) leave the GPU from
    stage 1, the bf16 gradient partition (2) at stage 3 too; the host holds them, per trainable parameter / 4."""
    offload = dict(bf16=True, offload=True, sub_group=150)
    assert model_states(TINY, 4, Zero(stage=0, **offload)) == (2000, 1600, 9600, 3200)  # stage 0: nothing to offload
    assert host_states(TINY, 4, Zero(stage=0, **offload)) == 0
    assert model_states(TINY, 4, Zero(stage=2, **offload)) == (2000, 2 * 800 / 4, 0, 0)
    assert host_states(TINY, 4, Zero(stage=2, **offload)) == 16 * 800 / 4 == 3200
    assert model_states(TINY, 4, Zero(stage=3, **offload)) == (2 * 1000 / 4, 0, 0, 0)
    assert host_states(TINY, 4, Zero(stage=3, **offload)) == (16 + 2) * 800 / 4 == 3600


def test_model_states_reproduce_deepspeeds_estimators():
    """DeepSpeed's estimators (no offload) count 2 + 18/N bytes per parameter at ZeRO-2 and 18/N + 4 x largest layer
    at ZeRO-3. Ours: the same at ZeRO-2; at ZeRO-3 2/N more (the bf16 gradient partition stage3.py keeps in
    `grad_partitions_flat_buffer`, which the estimator leaves out), with the gathered layer and its gradient its
    4 x largest layer (no prefetch, no reduce bucket: the estimator has neither). Frozen parameters, which the
    estimators do not know, save 18/N bytes each at ZeRO-2."""
    default_accelerator()
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total, largest, gpus = 8_000_000, 100_000, 8
    _, theirs2 = estimate_zero2_model_states_mem_needs(total, gpus, 1, cpu_offload=False)
    assert theirs2 == 2 * total + 18 * total // gpus == 34_000_000
    ours2 = sum(model_states(Params(total, total, largest, largest), gpus, Zero(stage=2, bf16=True)))
    assert ours2 == theirs2
    frozen = 1_000_000
    ours2_frozen = sum(model_states(Params(total, total - frozen, largest, largest), gpus, Zero(stage=2, bf16=True)))
    assert ours2_frozen == theirs2 - 18 * frozen / gpus == 31_750_000

    _, theirs3, layer = estimate_zero3_model_states_mem_needs(
        total, largest, gpus, 1, cpu_offload=False, cpu_offload_params=False, zero_init=True
    )
    assert (theirs3, layer) == (4 * largest + 18 * total // gpus, 4 * largest) == (18_400_000, 400_000)
    zero3 = Zero(stage=3, bf16=True, reduce_bucket=0, prefetch_bucket=0)
    states3 = sum(model_states(Params(total, total, largest, largest), gpus, zero3))
    ours3 = states3 + zero_buffers(largest, zero3) + gather_bytes(largest, largest, zero3)
    assert ours3 == theirs3 + 2 * total / gpus == 20_400_000


def test_parameter_counts_match_deepspeeds_on_a_real_model():
    """`count_params` on the meta device counts what DeepSpeed's `model_to_params` counts on real weights."""
    default_accelerator()
    from deepspeed.runtime.zero.stage3 import model_to_params

    config = _tiny_config()
    real = Qwen3MoeForCausalLM(config)
    counted = policy_and_critic(config, critic=False, frozen_attention=False)[0]
    assert (counted.total, counted.largest_layer) == model_to_params(real)
    # experts: 4 x (2 x 32 x 64 gate|up + 64 x 32 down) = 24,576 in one module, the largest; its fused gate_up_proj
    # (4 x 64 x 64 = 16,384) the largest single parameter
    assert counted.largest_layer == 4 * 3 * 32 * 64 == 24_576
    assert counted.largest_param == max(p.numel() for p in real.parameters()) == 4 * 64 * 64 == 16_384


def test_the_30b_architecture_counts_its_public_30_5b_parameters():
    """Qwen3-30B-A3B from the shipped config.json: per layer attention q 2048x4096 + k, v 2048x512 + o 4096x2048 +
    q/k norms 2x128 = 18,874,624, router 128x2048 = 262,144, experts 128 x 3 x 768 x 2048 = 603,979,776, two norms
    4,096 (623,120,640 in all); embeddings and the untied head 2 x 151,936 x 2048, the final norm 2,048. The critic
    drops the head, adds its value head (2,048 + 1) and freezes the 48 layers' attention."""
    cfg = load_config("qwen3-30b-a3b")
    policy, critic = policy_and_critic(hf_config(cfg.model), critic=True, frozen_attention=True)
    assert policy == Params(48 * 623_120_640 + 2 * 151_936 * 2048 + 2048, 30_532_122_624, 603_979_776, 402_653_184)
    assert critic.total == 30_532_122_624 - 151_936 * 2048 + 2049 == 30_220_959_745
    assert critic.trainable == critic.total - 48 * 18_874_624 == 29_314_977_793


def test_a_layer_keeps_the_bytes_the_formula_says():
    """The tiny decoder of `_tiny_config`: h 64, q 4x16 = 64, kv 2x16 = 32, a 4, g 2, E 4, k 2, f 32:
    norms 16h + 8 = 1032; q/k norms 6q + 6kv + 4a + 4g = 384 + 192 + 16 + 8 = 600; attention 2q + 4q (k, v
    repeated) + 2q + 4a = 528; router 4E + 12k + 4 = 44; experts k(4h + 8f + 26) = 2 x 538 = 1076: 3280 per token.
    Unpadded, k and v stay at kv width: 3280 - 4q + 4kv = 3152."""
    decoder = _tiny_decoder()
    assert layer_bytes_per_token(decoder) == 1032 + 600 + 528 + 44 + 1076 == 3280
    assert layer_bytes_per_token(decoder, padded=False) == 3152


def test_the_formula_is_what_autograd_saves(monkeypatch):
    """Every tensor the critic's bf16 forward saves for its backward (parameters aside), counted with
    saved-tensor hooks, is the formula's: two padded rows of 12 (one holds 8 tokens), 24 padded tokens, then one
    unpadded row of 12 (no mask, k and v unrepeated). Per layer: tokens x per-token bytes, the bf16 mask 2 x rows x
    len^2 and grouped_mm's int32 expert offsets 4E; per model: final norm and head input 8h + 4, token ids 8,
    rotary cos and sin 4 x head_dim x len. The boolean mask is counted by the planner (it lives through the pass)
    but saved by no one without checkpointing."""
    critic = ValueModel.from_policy(Qwen3MoeForCausalLM(_tiny_config())).to(torch.bfloat16)
    decoder = _tiny_decoder()
    ids = torch.randint(0, 50, (2, 12))
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[1, 8:] = 0
    per_model = 8 * 64 + 4 + 8
    # 2 x (24 x 3280 + 576 + 16) + 24 x 524 + 768 = 171,968
    assert _saved_bytes(critic, ids, padded) == activation_bytes(decoder, 24, 12, False) - padded_square(24, 12)
    assert _saved_bytes(critic, ids, padded) == 2 * (24 * 3280 + 2 * 2 * 12**2 + 16) + 24 * per_model + 4 * 16 * 12
    one_row = ids[:1].clone()  # its own storage: a view would count both rows' ids
    assert _saved_bytes(critic, one_row, torch.ones(1, 12, dtype=torch.long)) == (
        2 * (12 * layer_bytes_per_token(decoder, padded=False) + 16) + 12 * per_model + 4 * 16 * 12
    )


def test_activations_with_checkpointing_keep_each_layers_input_and_one_layer():
    """Checkpointed: each of the 2 layers keeps its bf16 input (2h = 128 per token) and one layer is recomputed at
    a time; the masks: 24 padded tokens in rows of 12 hold at most 2 rows x 12^2 = 288 (bool, once) and 2 x 288
    (bf16, the recomputed layer's)."""
    decoder = _tiny_decoder()
    layer = 24 * 3280 + 2 * 288 + 16
    model = 24 * (8 * 64 + 12) + 4 * 16 * 12 + 288
    assert activation_bytes(decoder, 24, 12, checkpointing=True) == 2 * 24 * 128 + layer + model
    assert activation_bytes(decoder, 24, 12, checkpointing=False) == 2 * layer + model


def test_the_token_budget_and_the_lm_head_chunk():
    # 128 trajectories over 8 ranks: 16 rows of up to 65,536 tokens in one pass, or micro-batches of the budget,
    # never less than one whole row, never more than the rank's share.
    assert micro_batch_tokens(128, 8, 65_536, 0) == 16 * 65_536
    assert micro_batch_tokens(128, 8, 65_536, 32_768) == 65_536
    assert micro_batch_tokens(128, 8, 65_536, 200_000) == 200_000
    assert micro_batch_tokens(128, 8, 65_536, 10**9) == 16 * 65_536
    # 16 x chunk x vocab: four fp32 (1024, 151,936) tensors; a shorter micro-batch is one shorter chunk
    assert logits_bytes(151_936, 65_536) == 16 * 1024 * 151_936 == 2_489_319_424
    assert logits_bytes(151_936, 100) == 16 * 100 * 151_936


def test_a_gpus_peak_is_the_states_plus_the_largest_working_set():
    # policy: states 10 + 5 + 20, backward 7 + 3 + 1 = 11, step 4; critic: states 8 + 4 + 16, backward 6, step 15.
    # They update one after the other: 35 + 28 + max(11, 4, 6, 15) = 78.
    policy = ModelMemory(10, 5, 20, 4, 7, 3, 1)
    critic = ModelMemory(8, 4, 16, 15, 6, 0, 0)
    assert gpu_peak([policy, critic]) == 78
    assert gpu_peak([policy]) == 35 + 11


def test_nccl_holds_each_communicators_ring_fifos_and_nvls_buffers():
    """Per rank and communicator: 32 channels x 2 ring connections x 10 MiB (LL 512 KiB + LL128 4,800 KiB + Simple
    4 MiB = 9.19 MiB, mapped at 2 MiB granularity) = 640 MiB, and 288 MiB of NVLS buffers beyond two GPUs."""
    assert nccl_group_bytes(1) == 0  # no peer
    assert nccl_group_bytes(2) == 32 * 2 * 10 * MIB == 671_088_640
    assert nccl_group_bytes(8) == 671_088_640 + 288 * MIB == 973_078_528
    with pytest.raises(ValueError, match="ranks"):
        nccl_group_bytes(0)


def test_the_transfer_keeps_two_buckets_per_server_on_the_gpu_each_at_least_the_largest_tensor():
    # 512 MiB buckets, but the 30B's gate_up_proj (402,653,184 bf16 elements, 805,306,368 bytes) goes alone; the
    # servers get their copies at once
    assert transfer_bytes(2, 512 * MIB, 805_306_368) == 2 * 2 * 805_306_368 == 3_221_225_472
    assert transfer_bytes(1, 512 * MIB, 1000) == 2 * 512 * MIB
    assert transfer_bytes(0, 512 * MIB, 1000) == 0


@pytest.mark.parametrize(
    "environ,on",
    [
        ({}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
        # torch reads the newer name first
        (
            {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
            False,
        ),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
    ],
)
def test_expandable_segments_are_read_as_torch_reads_them(environ, on):
    assert expandable_segments(environ) is on


def test_a_gpus_peak_adds_the_transfer_nccl_and_a_fragmentation_reserve():
    """The models of the test above (states 35 + 28 = 63, the larger working set 15) with a transfer of 6 and one
    two-GPU communicator (671,088,640, the NCCL test's): the allocator holds 63 + 15 + 6 = 84, the reserve is 10% of
    that (3% with expandable segments), and NCCL's buffers are outside the allocator."""
    models = (ModelMemory(10, 5, 20, 4, 7, 3, 1), ModelMemory(8, 4, 16, 15, 6, 0, 0))
    gpu = GpuMemory("policy+critic", models, (2,), 6.0, expandable=False)
    assert (gpu.allocated, gpu.nccl) == (84, 671_088_640)
    assert gpu.fragmentation == pytest.approx(8.4)
    assert gpu.peak == pytest.approx(84 + 8.4 + 671_088_640)
    assert dataclasses.replace(gpu, expandable=True).fragmentation == pytest.approx(0.03 * 84)


def test_rank_0s_gpu_holds_the_transfer_and_a_group_per_server():
    """Every GPU is in torchrun's world group and in its engine's group (DeepSpeed's clone of the world when
    shared, the model's own ranks when separate); the policy's first GPU also sends each version to 2 servers."""
    runtime = Runtime(transfer_servers=2, transfer_bucket=100, publish_overlap=True)
    w = dataclasses.replace(_tiny_workload(), runtime=runtime)
    shared = plan(w, 8, 2, "shared", capacity=1e12)
    (gpu,) = shared.kinds
    # 2 servers x 2 buckets of max(100 bytes, the largest parameter's 2 x 1,000)
    assert (gpu.groups, gpu.transfer, shared.transfer) == ((8, 8, 2, 2), 8000, 8000)
    policy, critic = plan(w, 8, 2, "separate", capacity=1e12, critic_ranks=3).kinds
    assert (policy.holds, policy.groups, policy.transfer) == ("policy", (8, 5, 2, 2), 8000)
    assert (critic.holds, critic.groups, critic.transfer) == ("critic", (8, 3), 0)
    assert plan(_tiny_workload(), 8, 2, "shared", capacity=1e12).transfer == 0  # no collective transfer


def test_a_plan_fits_when_it_keeps_a_tenth_free():
    w = _tiny_workload()
    peak = plan(w, 4, 2, "shared", capacity=1e12).peak
    at_the_edge = plan(w, 4, 2, "shared", capacity=peak / (1 - HEADROOM) * 1.000001)
    assert at_the_edge.free == pytest.approx(0.10 * at_the_edge.capacity, rel=1e-4) and at_the_edge.fits
    assert not plan(w, 4, 2, "shared", capacity=peak / (1 - HEADROOM) * 0.999).fits
    assert not plan(w, 4, 2, "shared", capacity=peak * 1.05).fits  # it fits the GPU, without the headroom


def test_separate_placement_splits_the_ranks_and_the_batch():
    """Policy on 3 of 4 GPUs, critic on 1 at ZeRO-2: the critic's GPU holds its whole optimizer and trains the
    whole batch; the policy's GPUs a third of its optimizer each and ceil(16 / 3) = 6 rows of 12 tokens."""
    w = _tiny_workload()
    p = plan(w, 4, 2, "separate", capacity=1e12, critic_ranks=1)
    assert (p.policy_ranks, p.critic_ranks, p.gpus, p.per_model) == (3, 1, 4, 3)
    assert p.tokens == 6 * 12
    assert p.critic.optimizer == 12 * w.critic.trainable  # ZeRO-2 over its one rank: nothing to split
    assert p.policy.optimizer == 12 * w.policy.trainable / 3
    assert [k.models for k in p.kinds] == [(p.policy,), (p.critic,)]
    assert p.peak == max(k.peak for k in p.kinds)
    shared = plan(w, 4, 2, "shared", capacity=1e12)
    assert (shared.policy_ranks, shared.critic_ranks, shared.gpus, shared.per_model) == (4, 4, 4, 4)
    assert shared.fullest.models == (shared.policy, shared.critic)
    assert shared.fullest.allocated == gpu_peak([shared.policy, shared.critic])  # no transfer in this workload
    with pytest.raises(ValueError, match="critic ranks"):
        plan(w, 4, 2, "separate", capacity=1e12, critic_ranks=4)


def test_the_cheapest_plan_has_the_fewest_gpus_per_model_then_the_lowest_stage():
    w = _tiny_workload()
    rows = plans(w, 4, capacity=1e12)
    # The separate placement at ZeRO stages 0-2 only (the learner refuses ZeRO-3 on part of the ranks).
    assert [(p.stage, p.placement) for p in rows] == [(s, pl) for s in range(4) for pl in ("shared", "separate")][:-1]
    best = cheapest(rows)
    assert (best.stage, best.placement, best.per_model) == (0, "separate", 2)  # 2 + 2 beats 4 shared
    assert cheapest(plans(w, 4, capacity=1.0)) is None


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-30b-a3b-coding"])
def test_the_30b_presets_keep_a_tenth_of_8_h200s_free_with_the_optimizer_on_the_host(preset):
    """The presets' plan with the optimizers on the GPUs (ZeRO-3, both models on the deployments' 8 GPUs of 141 GB),
    rank 0's GPU: states 2 x 60,753,082,369 / 8 + 2 x 59,847,100,417 / 8 + 12 x 59,847,100,417 / 8 = 119.92 GB; the
    policy's backward (activations 15.5, logits 2.49, buckets 2 x 200M + 2 x 603,979,776, gathered parameters 2.11);
    the transfer's two 805,306,368-byte buckets per server (2) during the step; NCCL 2 x 973,078,528 (torchrun's world
    and DeepSpeed's clone of it) + 2 x 671,088,640 (a pair per server); 10% of the allocator's 144.8 GB for
    fragmentation: 162.6 GB, 21.6 more than the GPU has. Eleven GPUs keep 10% free, ten do not. The presets put the
    optimizer on the host (infra/deepspeed/zero3-bf16-offload.json: its states, its fp32 gradients and the bf16
    gradient partition, 18 x 59,847,100,417 / 8 bytes per GPU there): the GPU keeps the weights, 15.19 GB, and the
    working set with the next layer's experts prefetched: 48.6 GB, 65% free (docs/gpu.md, "Memory")."""
    w = workload(load_config(preset, [ON_GPUS]), {})
    assert w.runtime == Runtime(transfer_servers=2, transfer_bucket=512 * MIB, publish_overlap=True)
    on_disk = load_config(preset, [ON_GPUS, 'rollout.weight_transfer="filesystem"', "rollout.publish_overlap=false"])
    assert workload(on_disk, {}).runtime == Runtime()  # no buckets on the GPU, no pair groups
    p = plan(w, 8, 3, "shared", 141e9)
    gpu = p.fullest
    states = sum(m.states for m in gpu.models)
    assert states == pytest.approx(119_920_696_322)
    assert (p.policy.buffers, p.policy.gather) == (2 * 200_000_000 + 2 * 603_979_776, 2_113_265_920)
    assert (gpu.transfer, gpu.nccl) == (3_221_225_472, 2 * 973_078_528 + 2 * 671_088_640)
    assert gpu.allocated == pytest.approx(states + p.policy.backward + 3_221_225_472)
    assert gpu.fragmentation == pytest.approx(0.10 * gpu.allocated)
    assert (round(gpu.allocated / 1e9, 1), round(p.peak / 1e9, 1), round(p.free / 1e9, 1)) == (144.8, 162.6, -21.6)
    assert not p.fits
    assert plan(w, 11, 3, "shared", 141e9).free >= 0.10 * 141e9 > plan(w, 10, 3, "shared", 141e9).free

    shipped = load_config(preset)
    assert shipped.train.deepspeed_config == "infra/deepspeed/zero3-bf16-offload.json"
    data = json.loads(Path(shipped.train.deepspeed_config).read_text())
    assert data["zero_optimization"] == {
        **json.loads(Path("infra/deepspeed/zero3-bf16.json").read_text())["zero_optimization"],
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "stage3_prefetch_bucket_size": 603_979_776,  # the next layer's whole experts module
        "stage3_max_live_parameters": 2_000_000_000,
    }
    w = workload(shipped, {})
    offloaded = plan(w, 8, 3, "shared", 141e9)
    assert w.zero.offload and (offloaded.policy.optimizer, offloaded.policy.gradients) == (0, 0)
    assert offloaded.fullest.host == pytest.approx(18 * 59_847_100_417 / 8)
    assert offloaded.fits and offloaded.free / offloaded.capacity >= 0.10
    assert round(offloaded.peak / 1e9, 1) == 48.6


def test_sao_plan_prints_a_table_the_fullest_gpu_line_by_line_and_what_would_fit(capsys):
    assert main(["plan", "--preset", "qwen3-30b-a3b", "--gpus", "8", "--set", ON_GPUS]) == 0
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line[:5].strip() in {"0", "1", "2", "3"}]
    assert [(row[0], row[1]) for row in table] == [(s, pl) for s in "0123" for pl in ("shared", "separate")][:-1]
    assert all(word in out.splitlines()[7].split() for word in ("gather", "transfer", "nccl", "reserve", "free"))
    assert "weight transfer: collective to 2 server(s) in buckets of 512 MiB, during the next step" in out
    # every line of the configured plan's fullest GPU, named
    assert "as configured (ZeRO-3, shared 8), the fullest GPU (policy+critic):" in out
    named = dict(re.findall(r"^  (\S+(?: \S+)?) +(-?\d+\.\d) GB", out, flags=re.MULTILINE))
    assert named == {
        "model states": "119.9",
        "working set": "21.7",
        "weight transfer": "3.2",
        "NCCL": "3.3",
        "fragmentation": "14.5",
        "peak": "162.6",
        "free": "-21.6",
    }
    assert "10% of the allocator's 144.8 GB without expandable segments" in out
    assert "nothing fits on 8 GPU(s) of 141 GB with 10% free" in out and "cheapest" not in out
    assert "rows of 32,768 tokens fit on 11 GPUs: ZeRO-3, shared 11, peak 126.6 GB" in out
    assert (
        "on 8 GPU(s) with the optimizer on the host: ZeRO-3, shared 8, peak 47.4 GB, 93.6 GB free (66%), 134.7 GB "
        "of host memory per GPU:\n    a copy of infra/deepspeed/zero3-bf16.json with "
        'zero_optimization.offload_optimizer = {"device": "cpu"}'
    ) in out


def test_sao_plan_names_the_cheapest_plan_that_keeps_a_tenth_free(capsys):
    assert main(["plan", "--preset", "qwen3-30b-a3b", "--gpus", "11", "--set", ON_GPUS]) == 0
    out = capsys.readouterr().out
    assert (
        "cheapest that fits: ZeRO-3, policy and critic on every GPU (11): peak 126.6 GB of 141 GB, 14.4 GB free" in out
    )
    assert 'settings: train.zero_stage = 3, train.deepspeed_config = "infra/deepspeed/zero3-bf16.json"' in out


def test_sao_plan_takes_expandable_segments_from_its_environment(monkeypatch, capsys):
    """With expandable segments the reserve is 3% of the same 144.8 GB: 4.3 GB, a peak of 152.4."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert main(["plan", "--preset", "qwen3-30b-a3b", "--gpus", "8", "--set", ON_GPUS]) == 0
    out = capsys.readouterr().out
    assert "the allocator's expandable segments in this environment: on" in out
    assert "  fragmentation      4.3 GB  3% of the allocator's 144.8 GB\n  peak             152.4 GB" in out


def test_sao_plan_says_what_would_fit_when_nothing_does(capsys):
    """65,536-token rows on 12 GPUs: 80 GB of states and twice the activations leave less than 10% free; 14 GPUs
    keep it, and on 12 rows of up to 46,080 tokens do."""
    argv = [
        "plan",
        "--preset",
        "qwen3-30b-a3b",
        "--gpus",
        "12",
        "--set",
        ON_GPUS,
        "--set",
        "rollout.max_total_tokens=65536",
    ]
    assert main([*argv, "--set", "train.micro_batch_tokens=65536"]) == 0
    out = capsys.readouterr().out
    assert "cheapest" not in out and "nothing fits on 12 GPU(s) of 141 GB with 10% free" in out
    assert "rows of 65,536 tokens fit on 14 GPUs: ZeRO-3, shared 14" in out
    assert "on 12 GPU(s), rows of up to 46,080 tokens fit: rollout.max_total_tokens = 46080" in out


@pytest.mark.parametrize(
    "argv,named",
    [
        (["plan", "--preset", "qwen3-30b-a3b", "--gpus", "0"], "--gpus: must be >= 1, got 0"),
        (["plan", "--preset", "qwen3-30b-a3b", "--gpus", "eight"], "--gpus: expected an integer, got 'eight'"),
        (["plan", "--gpus", "8", "--gpu-memory-gb", "-1"], "--gpu-memory-gb: must be > 0, got -1"),
        (["plan", "--gpus", "8", "--set", 'model.path="/nowhere/Unknown-7B"'], "model.path: /nowhere/Unknown-7B"),
    ],
)
def test_sao_plan_refuses_bad_input_naming_it(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and err.strip().splitlines()[-1].startswith("sao: ")


def _tiny_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _tiny_decoder() -> Decoder:
    return Decoder(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2, intermediate=32, vocab=50)


def _tiny_workload() -> Workload:
    policy = Params(total=10_000, trainable=10_000, largest_layer=1_000, largest_param=1_000)
    critic = Params(total=9_000, trainable=6_000, largest_layer=1_000, largest_param=1_000)
    zero = Zero(stage=0, bf16=True, reduce_bucket=100)
    return Workload(policy, critic, _tiny_decoder(), zero, batch_size=16, longest=12, budget=0, checkpointing=False)


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """Bytes of the distinct storages a forward saves for its backward, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, mask)
    return sum(saved.values())
