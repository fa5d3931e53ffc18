"""Rollout routing replay (components/models/routing.py): a router replaying recorded experts (hand-computed gate
weights), the embedded engine recording every position's experts, the runner's trajectories carrying them through
Parquet, and the trainer's MoE choosing exactly the engine's experts when a bf16 engine's routing differs from
fp32's."""

import asyncio
import copy

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from components.agent.runner import AgentRunner, EpisodeLimits
from components.chat import MarkerFormat
from components.contracts.trajectory import Routes, read_trajectories, to_tensors, write_trajectories
from components.data.tasks import generate_problems
from components.envs.tir_math import TIRMathEnvironment, tasks_from_problems
from components.models.routing import RouteRecorder, enable_replay, replay, routers, routes_shape
from components.rollout.embedded import EmbeddedEngine
from components.rollout.protocol import SamplingRequest


def _router() -> Qwen3MoeTopKRouter:
    """Hidden width 2, 3 experts, top 2, renormalised; logits (2, 1, 0) for the input (1, 0)."""
    cfg = type("C", (), {"num_experts_per_tok": 2, "num_experts": 3, "norm_topk_prob": True, "hidden_size": 2})
    router = Qwen3MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 0.0]]))
    return router


def test_a_replaying_router_takes_the_recorded_experts_and_weighs_them_by_its_own_probabilities():
    """Own routing picks experts (0, 1): weights e^2 / (e^2 + e) = 0.731059 and 0.268941. Replaying (2, 1) keeps
    the logits and weighs 2 and 1 by e^0 / (e^0 + e) = 0.268941 and 0.731059; a row of -1 routes itself."""
    router = _router()
    h = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    logits, own, experts = router(h)
    assert experts.tolist() == [[0, 1], [0, 1]]
    assert own[0].tolist() == pytest.approx([0.731059, 0.268941], abs=1e-6)
    model = torch.nn.Sequential(router)
    assert enable_replay(model) == 1 and enable_replay(model) == 1  # idempotent
    assert torch.equal(router(h)[1], own)  # enabled, nothing to replay: as before
    replay(model, torch.tensor([[[[2, 1]], [[-1, -1]]]], dtype=torch.int16))  # (batch 1, 2 tokens, 1 layer, top 2)
    replayed_logits, weights, chosen = router(h)
    assert chosen.tolist() == [[2, 1], [0, 1]] and torch.equal(replayed_logits, logits)
    assert weights[0].tolist() == pytest.approx([0.268941, 0.731059], abs=1e-6)
    assert weights[1].tolist() == pytest.approx([0.731059, 0.268941], abs=1e-6)
    (weights[0, 0] * 1.0).backward()  # the router still learns from a replayed token
    assert router.weight.grad.abs().sum() > 0
    replay(model, None)
    assert router(h)[2].tolist() == [[0, 1], [0, 1]]
    with pytest.raises(ValueError, match="routes: recorded for 2 MoE layers, the model replays 1"):
        replay(model, torch.zeros(1, 2, 2, 2, dtype=torch.int16))


def test_a_dense_model_is_refused_naming_the_field():
    with pytest.raises(ValueError, match='algo.routing_replay: "r3" replays MoE routing, and Linear has no MoE router'):
        routes_shape(torch.nn.Linear(2, 2))


def _own_routes(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), layers, top_k): the experts a teacher-forced forward over `ids` routes each position to."""
    with RouteRecorder(model) as recorder, torch.no_grad():
        model(torch.tensor([ids]))
        return recorder.take(1, len(ids))[0]


def test_the_engine_records_every_input_positions_experts(sft_policy):
    """A result's routes cover the prompt and every sampled token but the last (never an input), and an fp32 engine's
    equal the experts a teacher-forced forward of the same weights picks."""
    model, tokenizer = sft_policy
    layers, top_k = routes_shape(model)
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_batch=4, record_routes=True).start()
    try:
        prompts = [[1, 5, 9, 4, 7], [3, 3, 8]]
        futures = [engine.submit(SamplingRequest(p, max_tokens=12, seed=i)) for i, p in enumerate(prompts)]
        results = [f.result(timeout=60) for f in futures]
    finally:
        engine.shutdown()
    for prompt, result in zip(prompts, results):
        context = prompt + result.token_ids
        assert result.routes.shape == (len(context) - 1, layers, top_k) and result.routes.dtype == torch.int16
        assert torch.equal(result.routes, _own_routes(model, context[:-1]))


def test_trajectories_carry_the_routes_through_parquet_into_the_batch(sft_policy, tmp_path):
    model, tokenizer = sft_policy
    layers, top_k = routes_shape(model)
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_batch=8, record_routes=True).start()
    try:
        tasks = tasks_from_problems(generate_problems(("affine",), 6, 0, 99, "eval"))
        runner = AgentRunner(engine, MarkerFormat(tokenizer), TIRMathEnvironment(), EpisodeLimits(), 6)
        trajectories = asyncio.run(runner.run(tasks))
    finally:
        engine.shutdown()
    for t in trajectories:
        routes = t.routes.tensor(len(t.token_ids))
        last_action = t.reward_position()
        assert (routes[:last_action] >= 0).all() and (routes[last_action:] == -1).all()
        assert torch.equal(routes[:last_action], _own_routes(model, t.token_ids[:last_action]))
    back = read_trajectories(write_trajectories(tmp_path / "r.parquet", trajectories))
    assert [t.routes for t in back] == [t.routes for t in trajectories]
    batch = to_tensors(back, pad_id=0)
    longest = max(len(t.token_ids) for t in back)
    assert batch["routes"].shape == (len(back), longest, layers, top_k)
    assert (batch["routes"][0, len(back[0].token_ids) :] == -1).all()
    with pytest.raises(ValueError, match=r"routes hold 4 bytes, 3 tokens x 1 layers x 2 experts x 2 bytes need 12"):
        back[0].__class__(
            **{
                **back[0].__dict__,
                "token_ids": [1, 2, 3],
                "action_mask": [0, 0, 1],
                "rollout_logprobs": [None, None, -0.5],
                "versions": [None, None, 0],
                "prompt_len": 2,
                "routes": Routes(1, 2, b"\0" * 4),
            }
        ).validate()


def test_replayed_routes_make_the_trainers_moe_choose_the_bf16_engines_experts(sft_policy):
    """The engine samples in bf16 and records its routes; the trainer's fp32 forward over the same tokens picks other
    experts for some of them on its own, and exactly the engine's with the routes replayed."""
    model, tokenizer = sft_policy
    engine = EmbeddedEngine(copy.deepcopy(model).to(torch.bfloat16), tokenizer, max_batch=8, record_routes=True)
    engine.start()
    try:
        requests = [SamplingRequest([1 + i, 5, 9, 4, 7, 2 + i], max_tokens=40, seed=i) for i in range(8)]
        results = [f.result(timeout=120) for f in [engine.submit(r) for r in requests]]
    finally:
        engine.shutdown()
    trainer = copy.deepcopy(model)
    enable_replay(trainer)
    differ = total = 0
    for request, result in zip(requests, results):
        ids = (request.prompt_ids + result.token_ids)[:-1]
        own = _own_routes(trainer, ids)
        differ += int((own.sort(dim=-1).values != result.routes.sort(dim=-1).values).any(dim=-1).sum())
        total += own.shape[0] * own.shape[1]
        replay(trainer, result.routes[None])
        replayed = _own_routes(trainer, ids)  # the recorder sees what the replaying routers chose
        replay(trainer, None)
        assert torch.equal(replayed, result.routes)
    assert total > 0
    print(f"bf16 engine vs fp32 trainer: {differ} of {total} (position, layer) routes differ without replay")


def test_the_routers_are_found_in_layer_order(sft_policy):
    model, _ = sft_policy
    found = routers(model)
    assert found == [layer.mlp.gate for layer in model.model.layers]
