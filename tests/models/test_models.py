"""Models: tokenizer, model directories, chunked token log-probs, value model, frozen attention."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from components.config import ModelConfig
from components.contracts.markers import CALL, CALL_END, END, OUTPUT, OUTPUT_END
from components.models import (
    ValueModel,
    build_policy,
    build_tokenizer,
    freeze_attention,
    load_policy,
    load_tokenizer,
    save_model_dir,
    token_logprobs,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def policy(tokenizer):
    return build_policy(ModelConfig(), tokenizer, seed=0)


def test_tokenizer_round_trip_and_markers(tokenizer):
    text = f"<|user|>Compute 37*12+5.<|assistant|>{CALL}print(37*12+5){CALL_END}{OUTPUT}449\n{OUTPUT_END}\\boxed{{449}}{END}"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    # Each marker is one token; each character is one token.
    assert ids.count(tokenizer.convert_tokens_to_ids(CALL_END)) == 1
    assert len(tokenizer("abc")["input_ids"]) == 3
    assert tokenizer.decode(tokenizer("é")["input_ids"]) == "<|unk|>"


def test_model_directory_loads_with_transformers(tmp_path, tokenizer, policy):
    save_model_dir(policy, tokenizer, tmp_path / "m")
    files = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen3_moe"
    loaded, tok2 = load_policy(tmp_path / "m"), load_tokenizer(tmp_path / "m")
    ids = torch.tensor([tok2("12+3=")["input_ids"]])
    assert torch.equal(policy(ids).logits, loaded(ids).logits)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_policy(tmp_path / "missing")


def test_tiny_policy_is_about_a_million_parameters(policy):
    n_params = sum(p.numel() for p in policy.parameters())
    assert 0.5e6 < n_params < 1.5e6
    assert policy.config.head_dim >= 64 and policy.config.num_experts == 4


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_token_logprobs_equal_unchunked(policy, temperature):
    torch.manual_seed(0)
    ids = torch.randint(0, policy.config.vocab_size, (3, 41))
    logprobs, stats = token_logprobs(policy, ids, temperature, chunk_size=7, return_stats=True)
    logits = policy(ids).logits[:, :-1] / temperature
    full = torch.log_softmax(logits, dim=-1)
    expected = full.gather(2, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs[:, 1:], expected, atol=1e-5, rtol=0)
    assert torch.equal(logprobs[:, 0], torch.zeros(3))
    torch.testing.assert_close(stats.entropy[:, 1:], -(full.exp() * full).sum(-1), atol=1e-5, rtol=0)
    assert torch.equal(stats.is_argmax[:, 1:], full.argmax(-1) == ids[:, 1:]) and not stats.is_argmax[:, 0].any()
    greedy_ids = ids.clone()
    greedy_ids[:, 1] = full[:, 0].argmax(-1)  # the first prediction's prefix (token 0) is unchanged
    greedy = token_logprobs(policy, greedy_ids, temperature, chunk_size=7, return_stats=True)[1].is_argmax
    assert greedy[:, 1].all()
    # Gradients through the checkpointed chunks equal the unchunked ones.
    g_chunked = torch.autograd.grad(
        token_logprobs(policy, ids, temperature, chunk_size=7).sum(), policy.model.embed_tokens.weight
    )[0]
    g_full = torch.autograd.grad(expected.sum(), policy.model.embed_tokens.weight)[0]
    torch.testing.assert_close(g_chunked, g_full, atol=1e-5, rtol=1e-4)


def test_the_head_on_action_positions_only_gives_the_same_logprobs_and_gradients():
    """A large vocabulary (>= HEAD_GATHER_MIN_VOCAB) runs the head on the chosen positions only, through
    cross_entropy: the same log-probs, entropies, argmax flags and gradients there, 0 / False elsewhere."""
    from components.models.logprobs import HEAD_GATHER_MIN_VOCAB, head_positions

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=HEAD_GATHER_MIN_VOCAB + 3, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    action = torch.zeros(2, 9)
    action[0, 3:6], action[1, 7:] = 1, 1
    positions = head_positions(model, action)
    assert positions is not None
    full, full_stats = token_logprobs(model, ids, 0.7, chunk_size=3, return_stats=True)
    part, part_stats = token_logprobs(model, ids, 0.7, chunk_size=3, return_stats=True, positions=positions)
    torch.testing.assert_close(part[positions], full[positions], atol=1e-5, rtol=0)
    torch.testing.assert_close(part_stats.entropy[positions], full_stats.entropy[positions], atol=1e-5, rtol=0)
    assert torch.equal(part_stats.is_argmax[positions], full_stats.is_argmax[positions])
    assert not part[~positions].any() and not part_stats.entropy[~positions].any()
    assert not part_stats.is_argmax[~positions].any()
    head = model.get_output_embeddings().weight
    g_full = torch.autograd.grad((full * action).sum(), head)[0]
    g_part = torch.autograd.grad(token_logprobs(model, ids, 0.7, chunk_size=3, positions=positions).sum(), head)[0]
    torch.testing.assert_close(g_part, g_full, atol=1e-6, rtol=1e-4)


def test_a_small_vocabulary_keeps_the_full_head(policy):
    from components.models.logprobs import head_positions

    assert head_positions(policy, torch.ones(1, 4)) is None  # the character tokenizer's 106 entries


def test_token_logprobs_memory_is_bounded_at_large_vocab():
    # Full logits for 2 x 1024 tokens at a 262,144 vocabulary take 2.1 GB in fp32 (plus as much again for a
    # log-softmax and its gradient). Chunks of 128 positions hold ~134 MB each. Measure the child's peak RSS.
    script = textwrap.dedent("""
        import resource, torch
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from components.models import token_logprobs
        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=262144, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=1, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 1024))
        token_logprobs(model, ids[:, :8], 1.0, chunk_size=128).sum().backward()  # warm up allocator paths
        model.zero_grad()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        token_logprobs(model, ids, 0.7, chunk_size=128).sum().backward()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) / 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    growth_mb = float(out.stdout.strip().splitlines()[-1])
    assert growth_mb < 700, f"peak RSS grew {growth_mb:.0f} MB; full logits alone would be 2100 MB"


def test_value_model_reads_previous_position_and_round_trips(tmp_path, policy):
    critic = ValueModel.from_policy(policy)
    ids = torch.randint(0, policy.config.vocab_size, (2, 9))
    values = critic(ids)
    hidden = critic.backbone(input_ids=ids).last_hidden_state
    torch.testing.assert_close(values[:, 1:], critic.value_head(hidden).squeeze(-1)[:, :-1])
    assert torch.equal(values[:, 0], torch.zeros(2))
    # Initialised from the policy: same backbone weights, independent copies.
    assert torch.equal(critic.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert critic.backbone.embed_tokens.weight.data_ptr() != policy.model.embed_tokens.weight.data_ptr()
    restored = ValueModel.load(critic.save(tmp_path / "critic"))
    assert torch.equal(restored(ids), values)


def _tiny(family):
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common))
    return LlamaForCausalLM(LlamaConfig(**common))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_freeze_attention_names_per_family(family):
    model = _tiny(family)
    frozen = freeze_attention(model)
    attn_leaves = {"q_proj", "k_proj", "v_proj", "o_proj"} | ({"q_norm", "k_norm"} if family == "qwen3" else set())
    assert {name.split(".")[-2] for name in frozen} == attn_leaves
    assert len(frozen) == 2 * len(attn_leaves)  # two layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.0.input_layernorm.weight" in trainable and "model.layers.0.mlp.up_proj.weight" in trainable
    assert not trainable & set(frozen)


def test_freeze_attention_refuses_a_model_without_attention():
    with pytest.raises(ValueError, match="no attention parameters"):
        freeze_attention(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))


def test_frozen_critic_after_two_steps(policy):
    critic = ValueModel.from_policy(policy)
    frozen = set(freeze_attention(critic))
    assert any(".self_attn.q_norm." in n for n in frozen) and not any("layernorm" in n for n in frozen)
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    torch.manual_seed(1)
    ids = torch.randint(0, policy.config.vocab_size, (4, 16))
    targets = torch.randn(4, 16)
    for _ in range(2):
        optimizer.zero_grad()
        ((critic(ids) - targets) ** 2).mean().backward()
        optimizer.step()
    params = dict(critic.named_parameters())
    for name in frozen:
        assert torch.equal(params[name], before[name]), f"frozen {name} changed"
    moved = [n for n in params if n not in frozen and not torch.equal(params[n], before[n])]
    for expected in (
        "backbone.layers.0.mlp.experts.gate_up_proj",
        "backbone.layers.0.mlp.experts.down_proj",
        "backbone.layers.0.mlp.gate.weight",
        "value_head.weight",
        "value_head.bias",
    ):
        assert expected in moved, f"{expected} did not move"
