"""The rollout side of `sao plan` (components/training/plan/fleet.py): a server's memory and sampling rate, the rollout
GPUs that keep the trainer fed and the weight sync's time, each against numbers computed by hand."""

from __future__ import annotations

import pytest

from components.cli import main
from components.config import load_config
from components.training.plan.fleet import (
    Gpu,
    expert_params,
    experts_touched,
    kv_bytes_per_token,
    plan_fleet,
    sync_lines,
)
from components.training.plan.memory import Decoder, Params
from components.training.plan.model import decoder_sizes, hf_config
from components.training.plan.planner import workload

DENSE = Decoder(
    hidden=1000, layers=10, heads=8, kv_heads=2, head_dim=125, experts=0, top_k=1, intermediate=4000, vocab=1
)
BILLION = Params(total=10**9, trainable=10**9, largest_layer=1, largest_param=1)
GPU = Gpu("test", memory=100e9, hbm=1e12, flops=1e15)


def test_the_30b_kv_cache_and_its_active_parameters():
    """Qwen3-30B-A3B: 48 layers x 4 KV heads x 128 wide: 98,304 bytes per token in bf16; 128 experts of 3 x 2048 x
    768 per layer, 8 per token: 28.99B expert parameters, 3.35B active (the public "A3B")."""
    d = decoder_sizes(hf_config(load_config("qwen3-30b-a3b").model))
    assert kv_bytes_per_token(d) == 2 * 48 * 4 * 128 * 2 == 98_304
    total, active = expert_params(d)
    assert (total, active) == (48 * 128 * 4_718_592, 48 * 8 * 4_718_592) == (28_991_029_248, 1_811_939_328)
    policy = workload(load_config("qwen3-30b-a3b"), {}).policy
    assert 3.3e9 < policy.total - total + active < 3.4e9


def test_a_decode_step_touches_every_expert_some_sequence_routes_to():
    d = Decoder(hidden=1, layers=1, heads=1, kv_heads=1, head_dim=1, experts=4, top_k=1, intermediate=1, vocab=1)
    assert experts_touched(d, 1) == pytest.approx(1.0)
    assert experts_touched(d, 2) == pytest.approx(4 * (1 - (3 / 4) ** 2)) == pytest.approx(1.75)
    assert experts_touched(DENSE, 64) == 0.0


def test_a_dense_fleet_by_hand():
    """1B dense parameters on a 100 GB, 1 TB/s, 1 PFLOP/s GPU; 10 trajectories of 2,000 tokens; 8 training GPUs.
    KV: 2 x 10 x 2 x 125 x 2 = 10,000 bytes a token; (90 - 2) GB / 10 kB = 8.8M tokens; context 1,000: 256 sequences
    (vLLM's cap). A step reads 2 GB + 256 x 1,000 x 10 kB = 4.56 GB: 6.514 ms at 70% of 1 TB/s (compute: 2 x 1e9 x
    256 / 0.5 PFLOP/s = 1.024 ms), 39,298 tokens/s. Training: policy 8 x 1e9 + 4 x attention (4 x 10 x 8 x 125 x
    1,000 = 4e7) = 8.16e9 a token; critic 2 x 8.16e9 + 2e9 + 4e7 = 18.36e9; 20,000 tokens: 5.304e14 FLOPs, 0.2652 s
    on 8 GPUs at 25%. Rollout GPUs: 20,000 / (39,298 x 0.2652) = 1.92: 2."""
    cfg = load_config("qwen3-30b-a3b", ["train.batch_size=10", "algo.critic_updates=2"])
    f = plan_fleet(cfg, BILLION, DENSE, GPU, train_gpus=8, mean_tokens=2000)
    assert (f.tensor_parallel, f.kv_per_token, f.sequences) == (1, 10_000, 256)
    assert f.kv_tokens == pytest.approx(8.8e6)
    assert f.read == pytest.approx(4.56e9) and f.step == pytest.approx(4.56e9 / 0.7e12) and not f.compute_bound
    assert f.tokens_per_s == pytest.approx(256 * 0.7e12 / 4.56e9)
    assert f.train_flops == pytest.approx(20_000 * (8.16e9 + 18.36e9))
    assert f.train_s == pytest.approx(0.2652)
    assert (f.gpus_needed, f.configured_gpus) == (2, 2)


def test_weights_too_large_for_one_gpu_split_over_tensor_parallel_ones():
    """30B in bf16 (61 GB) on 80 GB: over 60% of the 72 GB a server takes, so two GPUs per server."""
    cfg = load_config("qwen3-30b-a3b")
    w = workload(cfg, {})
    f = plan_fleet(cfg, w.policy, w.decoder, Gpu("H100", 80e9, 3.35e12, 989e12), 8, 16_384)
    assert f.tensor_parallel == 2 and f.weights == pytest.approx(w.policy.total)  # 2 bytes / 2 GPUs
    assert f.configured_gpus == 4


def test_a_sync_under_five_seconds_and_one_the_senders_link_makes_impossible():
    cfg = load_config("qwen3-30b-a3b", ['rollout.transfer_senders="rank0"'])
    small = "\n".join(sync_lines(cfg, Params(10**9, 10**9, 1, 1), nodes=1, gpus=8, link=50e9, servers=4))
    assert "2.0 GB per version (1.00B x 2 bytes) to 4 server(s), from 1 sender" in small
    assert "send    0.2 s = 4 x 2.0 GB through the sender's 50 GB/s link" in small
    assert "total   0.16 s: under 5 s" in small  # 2e9 x 7/8 / 450e9 + 4 x 2e9 / 50e9 = 0.0039 + 0.16
    big = "\n".join(sync_lines(cfg, Params(30 * 10**9, 1, 1, 1), nodes=4, gpus=8, link=50e9, servers=20))
    assert "gather  1.2 s = 60.0 GB x 31/32 (ZeRO-3's shards) / 50 GB/s between nodes" in big
    assert "send    24.0 s = 20 x 60.0 GB" in big and "total   25.16 s\n" in big
    assert "over 5 s: the one sender's link makes it impossible (20 copies)" in big
    assert "= 1.2 s" in big  # every one of 32 GPUs sending: max(20 x 60 / 32 / 50, 60 / 50) = 1.2 s
    assert "over pod TCP (NCCL_IB_DISABLE=1, about 2 GB/s): send 600 s" in big


def test_every_rank_sending_brings_the_sync_to_each_servers_own_link():
    """The preset sends from every rank: 32 senders, 20 servers of 60 GB: max(20 x 60 / 32, 60) GB / 50 GB/s = 1.2 s,
    plus the gather 60 x 31/32 / 50 = 1.1625 s."""
    cfg = load_config("qwen3-30b-a3b")
    assert cfg.rollout.transfer_senders == "all"
    big = "\n".join(sync_lines(cfg, Params(30 * 10**9, 1, 1, 1), nodes=4, gpus=8, link=50e9, servers=20))
    assert 'from 32 senders (every policy rank: rollout.transfer_senders = "all")' in big
    assert "send    1.2 s = max(20 x 60.0 GB / 32 senders, 60.0 GB into each server) / 50 GB/s links" in big
    assert "total   2.36 s: under 5 s" in big
    slow = "\n".join(sync_lines(cfg, Params(30 * 10**9, 1, 1, 1), nodes=4, gpus=8, link=10e9, servers=20))
    assert "over 5 s: each server's own link at 10 GB/s make(s) it impossible" in slow  # 60 / 10 = 6 s alone


def test_sao_plan_on_four_nodes_prints_both_sides(capsys):
    assert main(["plan", "--preset", "qwen3-30b-a3b", "--nodes", "4", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sao plan: preset qwen3-30b-a3b, algorithm sao, on 4 nodes x 8 = 32 GPUs of 141 GB")
    assert "as configured (ZeRO-3, shared 32)" in out
    for line in ("rollout side (H200", "  rollout GPUs that keep it fed: ", "weight sync (collective, NCCL)"):
        assert line in out
    assert "configured: 2 server(s) (rollout.urls) sample a step in" in out
    assert "from 32 senders" in out and "total   2.40 s: under 5 s" in out  # the preset sends from every rank


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--nodes", "0"], "--nodes: must be >= 1, got 0"),
        (["--link-gb-s", "0"], "--link-gb-s: must be > 0, got 0"),
        (["--mean-tokens", "40000"], "--mean-tokens: 40000 is not within 1 .. rollout.max_total_tokens 32768"),
    ],
)
def test_sao_plan_refuses_a_bad_fleet_flag_naming_it(flags, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--preset", "qwen3-30b-a3b", "--gpus", "8", *flags])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
