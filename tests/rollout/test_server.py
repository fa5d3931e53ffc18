"""The embedded engine's HTTP server, exercised over real loopback HTTP with the async client."""

import asyncio
import copy

import httpx
import pytest
import torch

from components.models import token_logprobs
from components.rollout.client import EngineClient, EngineError
from components.rollout.embedded import EmbeddedEngine
from components.rollout.protocol import SamplingRequest
from components.rollout.server import ServerThread, create_app


@pytest.fixture(scope="module")
def server(two_versions):
    v0, _, tokenizer, _ = two_versions
    engine = EmbeddedEngine(copy.deepcopy(v0), tokenizer, max_batch=16, max_model_len=256).start()
    with ServerThread(create_app(engine, "tiny")) as url:
        yield url, engine
    engine.shutdown()


def _prompt(tokenizer, q="Compute 12*34+5."):
    return tokenizer(f"<|user|>{q}<|assistant|>")["input_ids"]


def test_completions_over_http_have_vllm_shape_and_exact_logprobs(server, two_versions):
    url, _ = server
    v0, _, tokenizer, _ = two_versions

    async def run():
        async with EngineClient(url, model="tiny") as client:
            return await asyncio.gather(
                *[
                    client.generate(
                        SamplingRequest(_prompt(tokenizer, f"Compute {i}*7+1."), max_tokens=20, temperature=0.7, seed=i)
                    )
                    for i in range(8)
                ]
            )

    for result in asyncio.run(run()):
        ids = torch.tensor([result.prompt_ids + result.token_ids])
        expected = token_logprobs(v0, ids, 0.7)[0, len(result.prompt_ids) :]
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)
    raw = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": _prompt(tokenizer),
            "max_tokens": 3,
            "logprobs": 1,
            "return_token_ids": True,
            "stop": ["<|/python|>"],
        },
    ).json()
    choice = raw["choices"][0]
    assert raw["object"] == "text_completion" and raw["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]) == len(choice["versions"])
    assert choice["finish_reason"] in ("stop", "length") and isinstance(choice["text"], str)
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 4}, "prompt"),  # missing prompt
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2], "temperature": -1}, "temperature"),
        ({"prompt": [1, 2], "top_p": 0.9}, "top_p"),  # truncated sampling breaks the IS ratio
        ({"prompt": [1, 2], "n": 2}, "n"),
        ({"prompt": [1, 2], "model": "other"}, "model"),
        ({"prompt": [1, 10_000]}, "prompt"),  # outside the vocabulary
        ({"prompt": [1] * 250, "max_tokens": 10}, "prompt"),  # longer than the context
        ({"prompt": ["a", 2]}, "prompt"),
        ({"prompt": [1, 2], "max_tokens": "many"}, "max_tokens"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(server, body, param):
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == param and param in error["message"]


def test_context_overflow_message_is_clear(server):
    url, _ = server
    error = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * 250, "max_tokens": 10}).json()["error"]
    assert "exceed the context length 256" in error["message"]
    broken = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400


def test_publish_weights_over_http(server, two_versions):
    url, engine = server
    _, v1, tokenizer, v1_path = two_versions

    async def run():
        async with EngineClient(url) as client:
            with pytest.raises(EngineError, match="path"):
                await client.publish_weights("/nonexistent/model", version=5)
            await client.publish_weights(str(v1_path), version=1)
            with pytest.raises(EngineError, match="version: 1 must be greater"):
                await client.publish_weights(str(v1_path), version=1)
            return await client.generate(SamplingRequest(_prompt(tokenizer), max_tokens=12, temperature=1.0, seed=1))

    result = asyncio.run(run())
    assert engine.version == 1 and result.versions == [1] * len(result.token_ids)
    ids = torch.tensor([result.prompt_ids + result.token_ids])
    torch.testing.assert_close(
        torch.tensor(result.logprobs), token_logprobs(v1, ids, 1.0)[0, len(result.prompt_ids) :], atol=1e-4, rtol=0
    )


def test_client_retries_then_raises_on_connection_errors():
    async def run():
        async with EngineClient("http://127.0.0.1:9", retries=2, timeout_s=2) as client:
            assert not await client.health()
            await client.generate(SamplingRequest([1, 2], max_tokens=1))

    with pytest.raises(httpx.ConnectError):
        asyncio.run(run())


def test_sao_engine_serve_cli(two_versions):
    """`sao engine serve` as a user runs it: a child process on a loopback port, real requests, then SIGTERM."""
    from components.rollout.server import serve_subprocess

    _, _, _, v1_path = two_versions
    with serve_subprocess(v1_path, threads=1) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "policy"
        body = {
            "prompt": "<|user|>Compute 2*3+4.<|assistant|>",
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
        }
        choice = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0


def test_the_update_mode_goes_to_the_server_drain_or_continue(two_versions):
    """`rollout.update_mode` over HTTP: a draining client's update waits for the request in flight, which ends on
    v0 alone; a continuing client's update lands mid-request, whose tokens then carry v1 after v0."""
    v0, _, tokenizer, v1_path = two_versions
    engine = EmbeddedEngine(copy.deepcopy(v0), tokenizer, max_batch=4, max_model_len=256).start()
    request = SamplingRequest(_prompt(tokenizer), max_tokens=150, temperature=1.0, seed=3, stop_token_ids=())

    async def update_during_a_request(mode: str, version: int):
        async with EngineClient(url, update_mode=mode) as client:
            long = asyncio.create_task(client.generate(request))
            while engine.in_flight == 0:
                await asyncio.sleep(0.005)
            await client.publish_weights(str(v1_path), version=version)
            return await long

    try:
        with ServerThread(create_app(engine, "tiny")) as url:
            drained = asyncio.run(update_during_a_request("drain", 1))
            continued = asyncio.run(update_during_a_request("continue", 2))
    finally:
        engine.shutdown()
    assert drained.versions == [0] * len(drained.token_ids) and engine.version == 2
    assert continued.versions[0] == 1 and continued.versions[-1] == 2
