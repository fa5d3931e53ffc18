"""A trainer resumed after a crash takes back the versions its predecessor published past the last checkpoint.

The crashed run is an `HttpRollouts` that published v1..v3 and is then abandoned (a killed trainer leaves its
servers alive, serving v3); the resumed run starts from its checkpoint at version 2. One server runs as a real
`sao engine serve` child process, so the `/health` path it reports is the CLI server's own answer.
"""

import asyncio
import copy

import httpx
import pytest
import torch

from components.models import save_model_dir
from components.rollout.backends import HttpRollouts
from components.rollout.embedded import EmbeddedEngine
from components.rollout.server import create_app
from components.storage import is_complete
from tests.rollout.test_backends import (
    _config,
    _engine_process,
    _request,
    _start_and_close,
    _teacher_forced,
    _version,
    _weights,
)


async def _crashed_run(urls, model, tokenizer, publish_dir, versions):
    """The predecessor: publishes each of `versions` (weights seeded by the version) to `urls`, then dies."""
    rollouts = HttpRollouts(_config(urls), model, tokenizer, publish_dir)
    await rollouts.start()
    for v in versions:
        await rollouts.publish(_weights(_version(model, seed=v)), v)
    await rollouts.close()


def test_server_ahead_from_this_publish_dir_is_rewound_before_traffic(tiny, serve, tmp_path):
    model, tokenizer = tiny
    published = tmp_path / "published"
    resumed, next_v3 = _version(model, seed=20), _version(model, seed=30)  # not the crashed v2, v3 (seeds 2, 3)
    local = serve(model, tokenizer)  # a server that restarted meanwhile: starting weights, version 0

    async def run(remote_url):
        await _crashed_run([remote_url], model, tokenizer, published, (1, 2, 3))
        ahead = httpx.get(f"{remote_url}/health").json()
        rollouts = HttpRollouts(_config([remote_url, local.url]), resumed, tokenizer, published, version=2)
        built = rollouts.metrics()["rollout/engines_live"], sorted(p.name for p in published.iterdir())
        await rollouts.start()
        started = (
            rollouts.metrics()["rollout/engines_live"],
            sorted(p.name for p in published.iterdir()),
            [s.last_error for s in rollouts.engine.servers],
            local.engine.version,
        )
        rewound = httpx.get(f"{remote_url}/health").json()
        first = await asyncio.gather(*(rollouts.engine.generate(_request(tokenizer, i)) for i in range(4)))
        await rollouts.publish(_weights(next_v3), 3)
        second = await asyncio.gather(*(rollouts.engine.generate(_request(tokenizer, i)) for i in range(4)))
        after = httpx.get(f"{remote_url}/health").json(), [s.served for s in rollouts.engine.servers]
        await rollouts.close()
        return ahead, built, started, rewound, first, second, after

    with _engine_process(save_model_dir(model, tokenizer, tmp_path / "policy")) as (_, remote_url):
        ahead, built, started, rewound, first, second, after = asyncio.run(run(remote_url))
    assert (ahead["version"], ahead["path"]) == (3, str(published.resolve() / "v00000003"))
    # Constructing touched nothing: both held, the crashed run's last two versions (v2, v3) still there. `start`
    # brought each to v2 before any traffic: the remote one rewound (7 -> 6 in production; going back takes the
    # rewind flag, tests below), the local one brought forward. The crashed v3 is gone; v2 holds the resumed weights.
    assert built == (0.0, ["v00000002", "v00000003"])
    assert started == (2.0, ["v00000002"], ["", ""], 2)
    assert (rewound["version"], rewound["path"]) == (2, str(published.resolve() / "v00000002"))
    assert all(r.versions == [2] * 8 for r in first)  # max_tokens=8, no stop token
    for result in first:
        torch.testing.assert_close(torch.tensor(result.logprobs), _teacher_forced(resumed, result), atol=1e-4, rtol=0)
    # The resumed run's own v3 (new weights in a rewritten v00000003) loads everywhere, and is what is sampled.
    health, served = after
    assert (health["version"], health["path"]) == (3, str(published.resolve() / "v00000003"))
    assert is_complete(published / "v00000003") and served == [4, 4]  # 2 + 2 per server, in turn
    assert all(r.versions == [3] * 8 for r in second)
    for result in second:
        torch.testing.assert_close(torch.tensor(result.logprobs), _teacher_forced(next_v3, result), atol=1e-4, rtol=0)


@pytest.mark.parametrize("loaded_from", ["another run", "a sibling of publish_dir", "its starting weights"])
def test_server_ahead_not_from_this_publish_dir_is_refused(tiny, serve, tmp_path, loaded_from):
    model, tokenizer = tiny
    published = tmp_path / "published"
    if loaded_from == "its starting weights":  # a server started at version 3 never loaded a path
        engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_batch=4, version=3, threads=1).start()
        try:
            server = serve(create_app(engine, "tiny"))
            with pytest.raises(ValueError) as refused:
                asyncio.run(
                    _start_and_close(HttpRollouts(_config([server.url]), model, tokenizer, published, version=2))
                )
        finally:
            engine.shutdown()
    else:
        other = tmp_path / "other-run" if loaded_from == "another run" else tmp_path / "published-old"
        server = serve(model, tokenizer)
        asyncio.run(_crashed_run([server.url], model, tokenizer, other, (1, 2, 3)))
        with pytest.raises(ValueError) as refused:
            asyncio.run(_start_and_close(HttpRollouts(_config([server.url]), model, tokenizer, published, version=2)))
    where = "its starting weights" if loaded_from == "its starting weights" else str(other.resolve() / "v00000003")
    assert str(refused.value) == (
        f"rollout.urls: {server.url} serves version 3, above the trainer's version 2, from {where}, not from this "
        f"run's publish_dir {published.resolve()}: it may serve another run; restart it from the trainer's starting "
        "weights"
    )
    assert not published.exists()  # refused before writing anything


def test_weights_going_back_need_the_rewind_flag_and_health_reports_the_path(tiny, serve, tmp_path):
    model, tokenizer = tiny
    server = serve(model, tokenizer)
    v0_dir, v1_dir = (
        save_model_dir(m, tokenizer, tmp_path / name) for m, name in ((model, "v0"), (_version(model, 1), "v1"))
    )
    health = [httpx.get(f"{server.url}/health").json()]
    answers = [
        httpx.post(f"{server.url}/v1/weights", json=body, timeout=60)
        for body in (
            {"path": str(v1_dir), "version": 1},
            {"path": str(v0_dir), "version": 1},  # not above 1: refused
            {"path": str(v0_dir), "version": 0, "rewind": False},  # below 1: refused
            {"path": str(v0_dir), "version": 0, "rewind": True},  # the flag lets it go back
        )
    ]
    health.append(httpx.get(f"{server.url}/health").json())
    assert [a.status_code for a in answers] == [200, 400, 400, 200]
    assert [a.json()["error"]["param"] for a in answers[1:3]] == ["version", "version"]
    assert answers[1].json()["error"]["message"] == (
        "version: 1 must be greater than the current version 1 (unless the request is a rewind)"
    )
    assert answers[2].json()["error"]["message"].startswith("version: 0 must be greater than the current version 1")
    assert [(h["version"], h["path"]) for h in health] == [(0, None), (0, str(v0_dir))]
    assert server.engine.stats.weight_updates == 2  # v1, then the rewind to v0; the refusals loaded nothing


def test_vllm_servers_report_no_version_and_are_never_rewound(tiny, serve, tmp_path):
    """vLLM's `/health` is an empty body: a resumed run cannot see its version, so `start` sends it the resumed
    weights (through the worker extension's reload) before any traffic, never marked for a rewind."""
    from fastapi import FastAPI, Response

    model, tokenizer = tiny
    app, calls = FastAPI(), []

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/collective_rpc")
    async def rpc(body: dict) -> dict:
        calls.append((body["method"], body["kwargs"]))
        return {"results": [{}]}  # one worker, nothing to report

    @app.post("/reset_prefix_cache")
    async def reset() -> dict:
        return {"success": True}

    server = serve(app)

    async def run():
        rollouts = HttpRollouts(_config([server.url], server="vllm"), model, tokenizer, tmp_path, version=3)
        try:
            await rollouts.start()
            pool_server = rollouts.engine.servers[0]
            return pool_server.up, pool_server.rewind, pool_server.version
        finally:
            await rollouts.close()

    assert asyncio.run(run()) == (True, False, 3)
    assert calls == [("sao_reload_weights", {"path": str(tmp_path.resolve() / "v00000003")})]
