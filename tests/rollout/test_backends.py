"""Rollout backends against real servers: the embedded server in this process (uvicorn threads) and a real
`sao engine serve` child process for the kill test. The models are untrained tiny policies: these tests check
routing, versions and fail-over, not what the model says."""

import asyncio
import contextlib
import copy
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from components.config import RolloutConfig
from components.models import save_model_dir, token_logprobs
from components.rollout.backends import EmbeddedRollouts, HttpRollouts
from components.rollout.client import EngineError
from components.rollout.engine_process import EngineProcess
from components.rollout.pool import EnginesDown
from components.rollout.protocol import SamplingRequest
from components.storage import is_complete


def _config(urls, **fields) -> RolloutConfig:
    """The `[rollout]` section of a run on the servers at `urls`. Unless `fields` say otherwise: one retry of a failed
    request, 30 s of waiting for a server to come back, and no weights probe (tests/rollout/test_transfer.py tests
    it), so that a test pays only for what it checks."""
    quick = {"request_retries": 1, "engine_wait_s": 30.0, "probe_every": 0}
    return RolloutConfig(backend="http", urls=tuple(urls), **{**quick, **fields})


async def _start_and_close(rollouts: HttpRollouts) -> None:
    """`start`, then `close` whether it raised or not (a refusal leaves nothing open)."""
    try:
        await rollouts.start()
    finally:
        await rollouts.close()


def _version(model, seed: int):
    """A perturbed copy of `model`: the weights a trainer would publish."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in out.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _request(tokenizer, i: int, max_tokens: int = 8) -> SamplingRequest:
    prompt = tokenizer(f"<|user|>Compute {i}*7+1.<|assistant|>")["input_ids"]
    return SamplingRequest(prompt, max_tokens=max_tokens, temperature=1.0, seed=i)


def _teacher_forced(model, result):
    ids = torch.tensor([result.prompt_ids + result.token_ids])
    return token_logprobs(model, ids, 1.0)[0, len(result.prompt_ids) :]


def _scripted(status: int) -> tuple[FastAPI, list[int]]:
    """A server that is healthy and takes weights, but answers every completion with HTTP `status`; counts the
    completions."""
    app, calls = FastAPI(), []
    served = {"version": 0, "path": None}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **served}

    @app.post("/v1/weights")
    async def weights(body: dict) -> dict:
        served.update(version=body["version"], path=body["path"])
        return {"version": body["version"]}

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        calls.append(1)
        return JSONResponse(status_code=status, content={"error": {"message": f"scripted HTTP {status}"}})

    return app, calls


@contextlib.contextmanager
def _engine_process(model_dir: Path):
    """`sao engine serve` as a child process we can SIGKILL; yields (process, url) once /health answers."""
    engine = EngineProcess(model_dir, threads=1).start()
    try:
        yield engine.proc, engine.url
    finally:
        engine.kill()


def test_embedded_rollouts_publish_then_generate(tiny):
    model, tokenizer = tiny
    v1 = _version(model, seed=1)
    before = _weights(model)

    async def run():
        rollouts = EmbeddedRollouts(model, tokenizer, max_batch=4, version=0, threads=1)
        first = await rollouts.engine.generate(_request(tokenizer, 1))
        await rollouts.publish(_weights(v1), 1)
        second = await rollouts.engine.generate(_request(tokenizer, 2))
        metrics = rollouts.metrics()
        await rollouts.close()
        return rollouts.version, first, second, metrics

    version, first, second, metrics = asyncio.run(run())
    assert version == 1 and metrics == {"rollout/engine_errors": 0.0}
    assert first.versions == [0] * 8 and second.versions == [1] * 8  # max_tokens=8, no stop tokens
    torch.testing.assert_close(torch.tensor(second.logprobs), _teacher_forced(v1, second), atol=1e-4, rtol=0)
    for name, tensor in model.state_dict().items():  # the engine loaded v1 into its own copy, not into `model`
        assert torch.equal(tensor, before[name]), name


def test_embedded_rollouts_drain_or_continue_as_the_update_mode_says(tiny):
    """`rollout.update_mode`: a request in flight when a version is published ends on v0 alone when draining, and
    goes on under v1 when continuing."""
    model, tokenizer = tiny
    v1 = _version(model, seed=1)

    async def run(drain: bool):
        rollouts = EmbeddedRollouts(model, tokenizer, max_batch=4, version=0, threads=1, drain=drain)
        long = asyncio.create_task(rollouts.engine.generate(_request(tokenizer, 1, max_tokens=200)))
        while rollouts.engine.in_flight == 0:
            await asyncio.sleep(0.005)
        await rollouts.publish(_weights(v1), 1)
        result = await long
        await rollouts.close()
        return result.versions

    drained, continued = asyncio.run(run(True)), asyncio.run(run(False))
    assert drained == [0] * 200
    assert continued[0] == 0 and continued[-1] == 1 and continued == sorted(continued)


def test_requests_spread_over_both_servers(tiny, serve, tmp_path):
    model, tokenizer = tiny
    a, b = serve(model, tokenizer), serve(model, tokenizer)

    async def run():
        rollouts = HttpRollouts(_config([a.url, b.url]), model, tokenizer, tmp_path / "published")
        await rollouts.start()
        results = await asyncio.gather(*(rollouts.engine.generate(_request(tokenizer, i)) for i in range(8)))
        served = [s.served for s in rollouts.engine.servers]
        await rollouts.close()
        return results, served

    results, served = asyncio.run(run())
    # Eight requests sent at once: each goes to the server with fewer in flight, ties alternating (a, b, a, ...).
    assert served == [4, 4]
    assert a.engine.stats.generated_tokens == b.engine.stats.generated_tokens == 4 * 8
    assert [r.prompt_ids for r in results] == [_request(tokenizer, i).prompt_ids for i in range(8)]


def test_publish_reaches_every_server_and_keeps_the_last_two_dirs(tiny, serve, tmp_path):
    model, tokenizer = tiny
    a, b = serve(model, tokenizer), serve(model, tokenizer)
    versions = {v: _version(model, seed=v) for v in (1, 2, 3)}

    async def run():
        rollouts = HttpRollouts(_config([a.url, b.url]), model, tokenizer, tmp_path / "published")
        await rollouts.start()
        seen = {}
        for v, weights in versions.items():
            await rollouts.publish(_weights(weights), v)
            reported = [httpx.get(f"{s.url}/health").json()["version"] for s in (a, b)]
            results = await asyncio.gather(*(rollouts.engine.generate(_request(tokenizer, i)) for i in range(4)))
            seen[v] = reported, results
        with pytest.raises(ValueError, match="version: 3 must be greater than the published version 3"):
            await rollouts.publish(_weights(versions[3]), 3)
        await rollouts.close()
        return rollouts.version, seen

    version, seen = asyncio.run(run())
    assert version == 3
    for v, (reported, results) in seen.items():
        assert reported == [v, v]  # the servers' own answer
        assert all(r.versions == [v] * len(r.token_ids) for r in results)
    for result in seen[3][1]:  # the tokens really come from v3's weights
        torch.testing.assert_close(
            torch.tensor(result.logprobs), _teacher_forced(versions[3], result), atol=1e-4, rtol=0
        )
    published = sorted(p.name for p in (tmp_path / "published").iterdir())
    assert published == ["v00000002", "v00000003"]
    assert all(is_complete(tmp_path / "published" / name) for name in published)


def test_server_killed_mid_run_fails_over_without_losing_or_duplicating_requests(tiny, serve, tmp_path):
    model, tokenizer = tiny
    model_dir = save_model_dir(model, tokenizer, tmp_path / "policy")
    local = serve(model, tokenizer)
    # 200 tokens each with no stop token: several hundred decode steps, far longer than the kill takes.
    requests = [_request(tokenizer, i, max_tokens=200) for i in range(12)]

    async def run(proc, remote_url):
        rollouts = HttpRollouts(
            _config([remote_url, local.url]), model, tokenizer, tmp_path / "published", revive_after_s=60
        )
        await rollouts.start()
        jobs = [asyncio.create_task(rollouts.engine.generate(r)) for r in requests]
        async with httpx.AsyncClient() as probe:  # wait until the remote engine holds its 6 requests
            deadline = time.monotonic() + 30
            while (await probe.get(f"{remote_url}/health")).json()["in_flight"] < 6:
                assert time.monotonic() < deadline, "the remote server never received its requests"
                await asyncio.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        first = await asyncio.gather(*jobs)
        later = await asyncio.gather(*(rollouts.engine.generate(r) for r in requests[:4]))
        state = [(s.up, s.served) for s in rollouts.engine.servers]
        metrics = rollouts.metrics()
        await rollouts.close()
        return first, later, state, metrics

    with _engine_process(model_dir) as (proc, remote_url):
        first, later, state, metrics = asyncio.run(run(proc, remote_url))
    assert [r.prompt_ids for r in first + later] == [r.prompt_ids for r in requests + requests[:4]]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 200 for r in first + later)
    # Round-robin gave the remote requests 0, 2, ..., 10; all six died with it and were answered by the local
    # server, once each: 12 + 4 answers in all, 6 errors, and the later ones never tried the dead server.
    assert state == [(False, 0), (True, 16)]
    assert _health_metrics(metrics) == {"rollout/engine_errors": 6.0, "rollout/engines_live": 1.0}


def test_server_errors_fail_over_but_bad_requests_are_not_retried(tiny, serve, tmp_path):
    model, tokenizer = tiny
    crashing_app, crashing_calls = _scripted(500)
    refusing_app, refusing_calls = _scripted(400)
    crashing, good, refusing = serve(crashing_app), serve(model, tokenizer), serve(refusing_app)

    async def run():
        rollouts = HttpRollouts(_config([crashing.url, good.url]), model, tokenizer, tmp_path / "a", revive_after_s=60)
        await rollouts.start()
        results = await asyncio.gather(*(rollouts.engine.generate(_request(tokenizer, i)) for i in range(4)))
        failover = rollouts.metrics(), [s.served for s in rollouts.engine.servers]
        await rollouts.close()
        rollouts = HttpRollouts(_config([refusing.url, good.url]), model, tokenizer, tmp_path / "b")
        await rollouts.start()
        with pytest.raises(EngineError, match="HTTP 400: scripted HTTP 400") as refused:
            await rollouts.engine.generate(_request(tokenizer, 0))
        refusal = rollouts.metrics(), refused.value.status
        await rollouts.close()
        return results, failover, refusal

    results, failover, refusal = asyncio.run(run())
    # Four requests at once: crashing, good, crashing, good (fewest in flight, ties alternating). Both sent to the
    # crashing server get a 500 and go to the good one; after that the crashing one is down and gets nothing.
    assert len(results) == 4 and crashing_calls == [1, 1]
    assert (_health_metrics(failover[0]), failover[1]) == (
        {"rollout/engine_errors": 2.0, "rollout/engines_live": 1.0},
        [0, 4],
    )
    assert refusing_calls == [1]  # sent once, raised, not retried on the good server
    assert (_health_metrics(refusal[0]), refusal[1]) == (
        {"rollout/engine_errors": 0.0, "rollout/engines_live": 2.0},
        400,
    )


def test_every_server_down_is_a_clear_error(tiny, serve, tmp_path):
    model, tokenizer = tiny
    nobody = _config(["http://127.0.0.1:9", "http://127.0.0.1:10"])
    unreachable = HttpRollouts(nobody, model, tokenizer, tmp_path, probe_timeout_s=1)  # asks nothing of them yet
    with pytest.raises(
        ConnectionError, match=r"rollout.urls: no engine server answers /health at http://127.0.0.1:9, "
    ):
        asyncio.run(_start_and_close(unreachable))
    a, b = serve(model, tokenizer), serve(model, tokenizer)

    async def run():
        rollouts = HttpRollouts(
            _config([a.url, b.url], request_retries=0), model, tokenizer, tmp_path, revive_after_s=60
        )
        await rollouts.start()  # both serve the trainer's v0: the failures below are the requests'
        a.stop()
        b.stop()
        try:
            with pytest.raises(EnginesDown) as down:
                await rollouts.engine.generate(_request(tokenizer, 0))
            return str(down.value), rollouts.metrics()
        finally:
            await rollouts.close()

    message, metrics = asyncio.run(run())
    assert message.startswith("every engine server is down: ") and a.url in message and b.url in message
    assert "ConnectError" in message
    assert _health_metrics(metrics) == {"rollout/engine_errors": 2.0, "rollout/engines_live": 0.0}


def test_a_short_outage_of_every_server_costs_time_not_episodes(tiny, serve, tmp_path):
    """The only server restarts: a request waits for it (probes due within max_wait_s) instead of failing."""
    model, tokenizer = tiny
    a = serve(model, tokenizer)

    async def run():
        rc = _config([a.url], request_retries=0, engine_wait_s=20.0)
        rollouts = HttpRollouts(rc, model, tokenizer, tmp_path, revive_after_s=0.2)
        await rollouts.start()  # it serves the trainer's v0: the failure below is the request's
        a.stop()
        restart = asyncio.get_running_loop().run_in_executor(
            None, lambda: (time.sleep(1.0), serve(model, tokenizer, port=a.port))[1]
        )
        result = await rollouts.engine.generate(_request(tokenizer, 0))  # fails on a, then waits for it
        await restart
        metrics = rollouts.metrics()
        await rollouts.close()
        return result, metrics

    result, metrics = asyncio.run(run())
    assert len(result.token_ids) > 0 and _health_metrics(metrics) == {
        "rollout/engine_errors": 1.0,
        "rollout/engines_live": 1.0,
    }


def test_revived_server_gets_the_latest_weights_before_traffic(tiny, serve, tmp_path):
    model, tokenizer = tiny
    a, b = serve(model, tokenizer), serve(model, tokenizer)
    v1, v2 = _version(model, seed=1), _version(model, seed=2)

    async def run():
        rollouts = HttpRollouts(
            _config([a.url, b.url], request_retries=0), model, tokenizer, tmp_path, revive_after_s=0.2
        )
        await rollouts.start()
        await rollouts.publish(_weights(v1), 1)
        b.stop()
        await asyncio.gather(*(rollouts.engine.generate(_request(tokenizer, i)) for i in range(2)))  # b fails
        assert rollouts.engine.servers[1].up is False
        await rollouts.publish(_weights(v2), 2)  # only a is live
        restarted = serve(model, tokenizer, port=b.port)  # back on the same port, with version 0's weights
        assert httpx.get(f"{restarted.url}/health").json()["version"] == 0
        await asyncio.sleep(0.3)  # past the back-off
        results = []
        for _ in range(50):  # until the revived server has answered some requests
            results += await asyncio.gather(*(rollouts.engine.generate(_request(tokenizer, i)) for i in range(4)))
            if rollouts.engine.servers[1].served >= 2:
                break
        served = [s.served for s in rollouts.engine.servers]
        await rollouts.close()
        return restarted, results, served

    restarted, results, served = asyncio.run(run())
    assert restarted.engine.version == 2 and served[1] >= 2
    assert restarted.engine.stats.generated_tokens >= 2 * 8
    # A request served before the revived server had v2 would carry version 0 (what it restarted with).
    assert all(r.versions == [2] * len(r.token_ids) for r in results)


def test_resumed_run_syncs_every_server_before_traffic(tiny, serve, tmp_path):
    model, tokenizer = tiny
    v5 = _version(model, seed=5)
    a, b = serve(model, tokenizer), serve(model, tokenizer)  # started from the starting weights: version 0

    async def run():
        rollouts = HttpRollouts(_config([a.url, b.url]), v5, tokenizer, tmp_path, version=5)
        assert rollouts.metrics()["rollout/engines_live"] == 0.0  # held until `start` brings them to v5
        await rollouts.start()
        assert rollouts.metrics()["rollout/engines_live"] == 2.0
        results = await asyncio.gather(*(rollouts.engine.generate(_request(tokenizer, i)) for i in range(4)))
        await rollouts.close()
        return results

    results = asyncio.run(run())
    assert a.engine.version == b.engine.version == 5
    assert all(r.versions == [5] * 8 for r in results)
    torch.testing.assert_close(torch.tensor(results[0].logprobs), _teacher_forced(v5, results[0]), atol=1e-4, rtol=0)
    # Ahead of a trainer that publishes elsewhere: another run's server, refused (this run's own crashed
    # predecessor, publishing into the same directory, is rewound instead: tests/rollout/test_resume_rewind.py).
    other_run = HttpRollouts(_config([a.url]), model, tokenizer, tmp_path / "other-run", version=3)
    with pytest.raises(ValueError, match=f"rollout.urls: {a.url} serves version 5, above the trainer's version 3"):
        asyncio.run(_start_and_close(other_run))


def test_a_fresh_run_serves_the_trainers_weights_before_the_first_rollout(tiny, serve, tmp_path):
    """Servers started from other weights (another checkpoint, another rope setting) never sample for the run:
    `start` sends version 0 from the trainer's own module to each, and a server missed there gets it on revival. A
    request before `start` fails at once, naming it, and reaches no server."""
    model, tokenizer = tiny
    other = _version(model, seed=7)
    a, b = serve(other, tokenizer), serve(other, tokenizer)
    published = (tmp_path / "published").resolve()

    async def run():
        rollouts = HttpRollouts(_config([a.url, b.url]), model, tokenizer, published)
        with pytest.raises(EnginesDown) as early:
            await rollouts.engine.generate(_request(tokenizer, 0))
        untouched = published.exists(), a.engine.stats.generated_tokens + b.engine.stats.generated_tokens
        await rollouts.start()
        health = [httpx.get(f"{url}/health").json() for url in (a.url, b.url)]
        results = await asyncio.gather(*(rollouts.engine.generate(_request(tokenizer, i)) for i in range(4)))
        await rollouts.close()
        return str(early.value), untouched, health, results

    early, untouched, health, results = asyncio.run(run())
    assert early.startswith("every engine server is down") and early.count("not started: `await rollouts.start()`") == 2
    assert untouched == (False, 0)  # nothing written, nothing generated before `start`
    assert [(h["version"], h["path"]) for h in health] == [(0, str(published / "v00000000"))] * 2
    assert a.engine.stats.weight_updates == b.engine.stats.weight_updates == 1
    for result in results:  # the trainer's weights, not the ones the servers were started from
        torch.testing.assert_close(torch.tensor(result.logprobs), _teacher_forced(model, result), atol=1e-4, rtol=0)


def _health_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The pool's health counters of a metrics row (the transfer's figures aside)."""
    return {k: metrics[k] for k in ("rollout/engine_errors", "rollout/engines_live")}
