"""Embedded engine: exact log-probs, continuous batching, in-flight weight updates, request validation."""

import random

import pytest
import torch

from components.contracts.markers import CALL_END, END
from components.models import token_logprobs
from components.rollout.embedded import EmbeddedEngine
from components.rollout.protocol import SamplingRequest


def _prompts(tokenizer, n, seed=0):
    rng = random.Random(seed)
    questions = [f"Compute {rng.randint(2, 99)}*{rng.randint(2, 99)}+{rng.randint(2, 99)}." for _ in range(n)]
    return [tokenizer(f"<|user|>{q}<|assistant|>")["input_ids"] for q in questions]


def _teacher_forced(model, result, temperature):
    ids = torch.tensor([result.prompt_ids + result.token_ids])
    return token_logprobs(model, ids, temperature)[0, len(result.prompt_ids) :]


def _drive(engine, futures):
    while not all(f.done() for f in futures):
        engine.step()
    return [f.result() for f in futures]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_equal_teacher_forced_logprobs(fresh_model, temperature):
    model, tokenizer = fresh_model
    engine = EmbeddedEngine(model, tokenizer, max_batch=8)  # 12 requests > 8 slots: requests queue and join
    stops = (tokenizer.convert_tokens_to_ids(CALL_END), tokenizer.convert_tokens_to_ids(END))
    futures = [
        engine.submit(SamplingRequest(p, max_tokens=24 + i, temperature=temperature, stop_token_ids=stops, seed=i))
        for i, p in enumerate(_prompts(tokenizer, 12))
    ]
    results = _drive(engine, futures)
    for result in results:
        expected = _teacher_forced(model, result, temperature)
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)
        assert result.versions == [0] * len(result.token_ids)
    assert {r.finish_reason for r in results} <= {"stop", "length"}


def test_requests_joining_mid_flight_decode_exactly_as_alone(fresh_model):
    model, tokenizer = fresh_model
    prompts = _prompts(tokenizer, 5, seed=1)
    solo = []
    for p in prompts:
        alone = EmbeddedEngine(model, tokenizer)
        solo.append(_drive(alone, [alone.submit(SamplingRequest(p, max_tokens=30, temperature=0))])[0])
    engine = EmbeddedEngine(model, tokenizer)
    futures = []
    for p in prompts:  # a new request joins every two decode steps; short ones leave while others run
        futures.append(engine.submit(SamplingRequest(p, max_tokens=30, temperature=0)))
        engine.step()
        engine.step()
    batched = _drive(engine, futures)
    for a, b in zip(batched, solo):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_same_seed_same_sample(fresh_model):
    model, tokenizer = fresh_model
    engine = EmbeddedEngine(model, tokenizer)
    prompt = _prompts(tokenizer, 1)[0]
    a, b, c = _drive(engine, [engine.submit(SamplingRequest(prompt, 20, 1.0, seed=s)) for s in (3, 3, 4)])
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_weight_update_mid_generation_switches_versions_and_logprobs(two_versions):
    import copy

    v0, v1, tokenizer, v1_path = two_versions
    engine = EmbeddedEngine(copy.deepcopy(v0), tokenizer)
    future = engine.submit(SamplingRequest(_prompts(tokenizer, 1)[0], max_tokens=30, temperature=1.0, seed=0))
    for _ in range(10):  # 10 tokens under version 0
        engine.step()
    update = engine.load_weights(v1_path, version=1)
    result = _drive(engine, [future])[0]
    assert update.done() and engine.version == 1
    assert result.versions == [0] * 10 + [1] * 20
    # Each token's log-prob is what the weights that produced it give it, teacher-forced on the whole sequence.
    torch.testing.assert_close(
        torch.tensor(result.logprobs[:10]), _teacher_forced(v0, result, 1.0)[:10], atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        torch.tensor(result.logprobs[10:]), _teacher_forced(v1, result, 1.0)[10:], atol=1e-4, rtol=0
    )
    assert (torch.tensor(result.logprobs[10:]) - _teacher_forced(v0, result, 1.0)[10:]).abs().max() > 1e-2


def test_no_request_lost_or_duplicated_across_an_update(two_versions):
    import copy

    v0, _, tokenizer, v1_path = two_versions
    engine = EmbeddedEngine(copy.deepcopy(v0), tokenizer, max_batch=6).start()
    try:
        prompts = _prompts(tokenizer, 20, seed=2)
        futures = [
            engine.submit(SamplingRequest(p, max_tokens=25, temperature=1.0, seed=i)) for i, p in enumerate(prompts)
        ]
        engine.load_weights(v1_path, version=1).result(timeout=60)
        results = [f.result(timeout=120) for f in futures]
    finally:
        engine.shutdown()
    assert [r.prompt_ids for r in results] == prompts
    assert all(r.finish_reason == "length" and len(r.token_ids) == 25 for r in results)
    assert all(r.versions == sorted(r.versions) for r in results)  # versions never go back
    assert {v for r in results for v in r.versions} == {0, 1}


def test_a_draining_update_waits_for_the_sequences_in_flight_and_admits_none_meanwhile(two_versions):
    """vLLM's way, kept as an option: the two sequences in flight finish on version 0 (one token each was sampled
    before the update), the one submitted after the update waits for them and samples on version 1 alone."""
    import copy

    v0, _, tokenizer, v1_path = two_versions
    engine = EmbeddedEngine(copy.deepcopy(v0), tokenizer, max_batch=4)
    long, short = (
        engine.submit(SamplingRequest(p, max_tokens=n, seed=n)) for p, n in zip(_prompts(tokenizer, 2), (8, 3))
    )
    engine.step()  # both admitted: one token each
    update = engine.load_weights(v1_path, version=1, drain=True)
    late = engine.submit(SamplingRequest(_prompts(tokenizer, 1, seed=5)[0], max_tokens=4, seed=9))
    steps = 0
    while not long.done():
        engine.step()
        steps += 1
        assert not late.done() and engine.in_flight == 1 + (not long.done()) + (not short.done())  # late waits
    assert not update.done() and engine.version == 0 and steps == 7  # 7 more tokens of the long one, none of late
    results = _drive(engine, [late])
    assert update.done() and engine.version == 1
    assert long.result().versions == [0] * 8 and short.result().versions == [0] * 3
    assert results[0].versions == [1] * 4


def test_invalid_requests_and_weights_are_refused(fresh_model, tmp_path):
    model, tokenizer = fresh_model
    engine = EmbeddedEngine(model, tokenizer, max_model_len=64)
    with pytest.raises(ValueError, match="prompt: 60 tokens \\+ max_tokens 10 exceed the context length 64"):
        engine.submit(SamplingRequest([5] * 60, max_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(SamplingRequest([5, 10_000], max_tokens=2))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingRequest([5], max_tokens=0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="'model.norm.weight' has shape \\(3,\\)"):
        engine.load_weights(state, version=1)
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match="missing tensor 'model.norm.weight'"):
        engine.load_weights(state, version=1)
    stale = engine.load_weights({k: v.clone() for k, v in model.state_dict().items()}, version=0)
    engine.step()
    with pytest.raises(ValueError, match="version: 0 must be greater than the current version 0"):
        stale.result()


def test_samples_follow_the_tempered_distribution(fresh_model):
    # 1,536 one-token samples of the same prompt at T = 0.7: the empirical distribution of the first token must
    # match softmax(logits / 0.7) (total variation < 0.05; sampling noise alone gives about 0.02 here).
    model, tokenizer = fresh_model
    # The next token is the first operand's leading digit, which the policy cannot know: several are plausible.
    prompt = tokenizer("<|user|>Compute ")["input_ids"]
    engine = EmbeddedEngine(model, tokenizer, max_batch=64)
    futures = [engine.submit(SamplingRequest(prompt, max_tokens=1, temperature=0.7, seed=i)) for i in range(1536)]
    tokens = torch.tensor([r.token_ids[0] for r in _drive(engine, futures)])
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / 0.7, dim=-1)
    empirical = torch.bincount(tokens, minlength=probs.numel()).float() / len(tokens)
    assert 0.5 * (empirical - probs).abs().sum() < 0.05
    assert probs.max() < 0.9, "the prompt must leave several plausible tokens for the test to mean anything"
