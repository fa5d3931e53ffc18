"""Routing replay over HTTP (`algo.routing_replay = "r3"`): vLLM's `routed_experts` (a base64 `.npy` array of every
input position's experts, `--enable-return-routed-experts`) decoded into `SamplingResult.routes`; the settings that
cannot carry routes refused naming the fields; a server that returns none refused at start. vLLM 0.32 returns them
only from Model Runner V2, which needs Triton, so no vLLM here (CPU) can: the server below is a stand-in that
answers in vLLM's shape, over real HTTP."""

import asyncio
import base64
import io

import numpy
import pytest
import torch
from fastapi import FastAPI

from components.config import RolloutConfig
from components.rollout.backends import HttpRollouts, open_rollouts
from components.rollout.client import parse_completion
from components.rollout.server import ServerThread


def _encoded(array: numpy.ndarray) -> str:
    buffer = io.BytesIO()
    numpy.save(buffer, array, allow_pickle=False)  # as vLLM's numpy2base64 does
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _choice(routes: str | None, tokens=(7, 8)) -> dict:
    choice = {
        "token_ids": list(tokens),
        "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
        "finish_reason": "length",
    }
    return {"choices": [choice | ({"routed_experts": routes} if routes is not None else {})]}


def test_vllms_routed_experts_become_the_results_routes():
    # a prompt of 3 and 2 sampled tokens: 4 input positions (the last sampled token never was one), 2 layers, top 2
    experts = numpy.arange(16, dtype=numpy.uint8).reshape(4, 2, 2)
    result = parse_completion(_choice(_encoded(experts)), [1, 2, 3], 0)
    assert result.routes.dtype == torch.int16 and result.routes.tolist() == experts.tolist()
    assert parse_completion(_choice(None), [1, 2, 3], 0).routes is None
    with pytest.raises(
        ValueError, match=r"routed_experts: expected integers shaped \(4, layers, top_k\), got uint8 \(3, 2, 2\)"
    ):
        parse_completion(_choice(_encoded(experts[:3])), [1, 2, 3], 0)
    with pytest.raises(ValueError, match=r"routed_experts: not a base64 \.npy array"):
        parse_completion(_choice("bm90IG5weQ=="), [1, 2, 3], 0)


def test_settings_that_cannot_carry_routes_are_refused_naming_them(tiny, tmp_path):
    model, tokenizer = tiny
    for fields, named in (
        ({"server": "sao"}, 'rollout.server = "sao"'),
        ({"server": "vllm"}, 'rollout.update_mode = "continue"'),
    ):
        rc = RolloutConfig(backend="http", urls=("http://127.0.0.1:9",), **fields)
        with pytest.raises(ValueError, match=f'algo.routing_replay: "r3" needs .*{named}'):
            open_rollouts(rc, model, tokenizer, tmp_path, 0, 1, record_routes=True)


def test_a_server_that_returns_no_routes_is_refused_at_start(tiny, tmp_path):
    model, tokenizer = tiny
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        return _choice(None, tokens=[5] * body["max_tokens"])

    with ServerThread(app) as url:
        rc = RolloutConfig(backend="http", urls=(url,), server="vllm", update_mode="drain", probe_every=0)
        rollouts = HttpRollouts(rc, model, tokenizer, tmp_path / "published", record_routes=True)

        async def start():
            try:
                await rollouts.start()
            finally:
                await rollouts.close()

        with pytest.raises(ValueError, match=f"{url} returned none: start vLLM with --enable-return-routed-experts"):
            asyncio.run(start())
