"""Weights into real vLLM servers (`make test-vllm`): both transports, versions that stay true when the weights change
under a running request, and the trainer's `HttpRollouts` over two servers with the collective transport.

Two servers of a tiny dense Qwen3 that never samples EOS (so a request runs to its `max_tokens`) are shared by the
module (conftest.py `dense`); every test first loads the version it starts from. Log-probs are compared with this
venv's teacher-forced `token_logprobs` at 1e-4, as in test_vllm_protocol.py (fp32 on both sides agree to ~1e-6).
"""

import asyncio
import sys
import time

import httpx
import pytest
import torch

from components.config import RolloutConfig
from components.models import save_model_dir, token_logprobs
from components.rollout.backends import HttpRollouts
from components.rollout.client import EngineClient
from components.rollout.senders import FollowerSender
from components.rollout.transfer import Sender
from tests.vllm.harness import (
    TRANSFERS,
    Publisher,
    VLLMServer,
    dense_qwen3,
    logprob_gap,
    perturbed,
    requests,
    sample,
    until,
)

pytestmark = pytest.mark.vllm
LONG = 1500
"""Tokens of the request in flight while the weights change: ~4 s here (200 took 0.5 s, too close to what posting
the update can take), so the update surely comes while it runs; each test asserts that it did."""
SETTLE_S = 0.5
"""How long the long request runs before the weights change (vLLM's `num_requests_running` gauge lags by more)."""


def test_filesystem_publish_switches_to_the_new_weights(dense, tokenizer, tmp_path):
    url, (v0, v1, _) = dense.urls[0], dense.models

    async def main():
        async with EngineClient(url, backend="vllm") as client:
            publish = Publisher("filesystem", tokenizer, tmp_path)
            await publish(client, v0, 0)
            assert logprob_gap(v0, await sample(url, tokenizer, 0.7), 0.7) < 1e-4
            start = time.perf_counter()
            await publish(client, v1, 1)
            return time.perf_counter() - start

    seconds = asyncio.run(main())
    results = asyncio.run(sample(url, tokenizer, 0.7, version=1))
    print(f"vLLM weight publish (save + reload) took {seconds * 1e3:.0f} ms")
    assert logprob_gap(v1, results, 0.7) < 1e-4
    assert logprob_gap(v0, results, 0.7) > 1e-2
    assert all(r.versions == [1] * len(r.token_ids) for r in results)


@pytest.mark.parametrize("how", TRANSFERS)
def test_a_request_in_flight_finishes_on_the_weights_it_was_sent_to(how, dense, tokenizer, tmp_path):
    """`update_mode="drain"`: v1 is published while a 1500-token request runs on v0: the request finishes on v0 (all
    its tokens tagged v0, with v0's log-probs), the load waits for it, and a request made while the load is pending
    waits and then runs on v1, as does one made after."""
    url, (v0, v1, _) = dense.urls[0], dense.models
    long_request = requests(tokenizer, 1.0, n=1, max_tokens=LONG, seed=100)[0]
    held_requests = requests(tokenizer, 1.0, n=3, seed=200)
    after_requests = requests(tokenizer, 1.0, n=3, seed=300)

    async def main():
        publish = Publisher(how, tokenizer, tmp_path)
        async with EngineClient(url, backend="vllm", update_mode="drain") as client:
            await publish(client, v0, 0)  # a shared server: another test may have left other weights on it
            done: list[tuple[str, float]] = []
            start = time.monotonic()
            long = asyncio.create_task(client.generate(long_request))
            long.add_done_callback(lambda _: done.append(("long answered", time.monotonic() - start)))
            await asyncio.sleep(SETTLE_S)
            update = asyncio.create_task(publish(client, v1, 1))
            update.add_done_callback(lambda _: done.append(("v1 loaded", time.monotonic() - start)))
            await until(lambda: client.updating, what="the update closing the gate")
            # The precondition of the whole test: the update is pending while the long request still runs.
            assert not long.done(), "the long request ended before the update began: make it longer"
            requested = time.monotonic() - start
            held = [asyncio.create_task(client.generate(r)) for r in held_requests]
            for task in held:
                task.add_done_callback(lambda _: done.append(("held answered", time.monotonic() - start)))
            long_result, held_results = await long, await asyncio.gather(*held)
            await update
            after_results = await asyncio.gather(*(client.generate(r) for r in after_requests))
            return long_result, held_results, after_results, done, requested

    long_result, held_results, after_results, done, requested = asyncio.run(main())
    print(f"{how}: update requested at {requested:.2f} s; " + ", ".join(f"{what} at {t:.2f} s" for what, t in done))
    # The load began only once the request in flight was answered, and the requests made meanwhile went out after it.
    assert [what for what, _ in done] == ["long answered", "v1 loaded"] + ["held answered"] * len(held_requests)
    # Every token of the long request was sampled by v0: it ran to its length (no EOS), all tagged v0, and each
    # log-prob is v0's teacher-forced one (v1's differ by far more than the tolerance on the same tokens).
    assert long_result.finish_reason == "length" and len(long_result.token_ids) == LONG
    assert long_result.versions == [0] * LONG
    assert logprob_gap(v0, [long_result], 1.0) < 1e-4
    assert logprob_gap(v1, [long_result], 1.0) > 1e-2
    for results in (held_results, after_results):
        assert all(r.versions == [1] * len(r.token_ids) for r in results)
        assert logprob_gap(v1, results, 1.0) < 1e-4
        assert logprob_gap(v0, results, 1.0) > 1e-2


@pytest.mark.parametrize("how", TRANSFERS)
def test_a_request_in_flight_continues_on_the_new_weights(how, dense, tokenizer, tmp_path):
    """`update_mode="continue"` (the default): v1 is published while a 1500-token request runs on v0. The update does
    not wait for it: the client aborts the request, v1 loads, and the request goes on from its generated prefix. Its
    answer carries both versions, v0's tokens first, each part's log-probs those of the version that sampled it
    (v1's teacher-forced on the whole prefix: vLLM recomputed its KV on v1), and it has its whole budget: nothing
    is lost across the update. A request made while the update is pending runs on v1."""
    url, (v0, v1, _) = dense.urls[0], dense.models
    long_request = requests(tokenizer, 1.0, n=1, max_tokens=LONG, seed=100)[0]
    held_requests = requests(tokenizer, 1.0, n=3, seed=200)

    async def main():
        publish = Publisher(how, tokenizer, tmp_path)
        async with EngineClient(url, backend="vllm") as client:
            assert client.update_mode == "continue"
            await publish(client, v0, 0)  # a shared server: another test may have left other weights on it
            done: list[str] = []
            start = time.monotonic()
            long = asyncio.create_task(client.generate(long_request))
            long.add_done_callback(lambda _: done.append(f"long answered at {time.monotonic() - start:.2f} s"))
            await asyncio.sleep(SETTLE_S)
            done.append(f"update requested at {time.monotonic() - start:.2f} s")
            update = asyncio.create_task(publish(client, v1, 1))
            update.add_done_callback(lambda _: done.append(f"v1 loaded at {time.monotonic() - start:.2f} s"))
            await until(lambda: client.updating, what="the update closing the gate")
            held = [asyncio.create_task(client.generate(r)) for r in held_requests]
            await update
            return await long, await asyncio.gather(*held), done

    long_result, held_results, done = asyncio.run(main())
    versions = long_result.versions
    switch = versions.index(1) if 1 in versions else len(versions)
    print(f"{how}: the long request continued at token {switch} of {LONG}; " + ", ".join(done))
    assert done[1].startswith("v1 loaded") and done[2].startswith("long answered"), done  # the load did not wait
    assert long_result.finish_reason == "length" and len(long_result.token_ids) == LONG
    assert 0 < switch < LONG and versions == [0] * switch + [1] * (LONG - switch)
    ids = torch.tensor([long_result.prompt_ids + long_result.token_ids])
    got, start = torch.tensor(long_result.logprobs), len(long_result.prompt_ids)
    own = [token_logprobs(m, ids, 1.0)[0, start:] for m in (v0, v1)]
    assert (got[:switch] - own[0][:switch]).abs().max() < 1e-4  # the v0 part: v0's log-probs
    assert (got[switch:] - own[1][switch:]).abs().max() < 1e-4  # the v1 part: v1's, on the whole prefix
    assert (got[switch:] - own[0][switch:]).abs().max() > 1e-2  # and not v0's
    assert all(r.versions == [1] * len(r.token_ids) for r in held_results)
    assert logprob_gap(v1, held_results, 1.0) < 1e-4


def test_without_the_gate_vllm_reloads_under_a_running_request(dense, tokenizer, tmp_path):
    """What the gate prevents, on this vLLM: the worker's reload posted straight to `/collective_rpc` while a request
    runs lands between two decode steps, so the request's first tokens come from v0 and its later ones from v1 on
    v0's KV cache (matching neither version's teacher-forced log-probs); `/reset_prefix_cache` meanwhile refuses."""
    url, (v0, v1, _) = dense.urls[1], dense.models
    v1_dir = save_model_dir(v1, tokenizer, tmp_path / "v1")
    long_request = requests(tokenizer, 1.0, n=1, max_tokens=LONG, seed=100)[0]

    async def main():
        async with EngineClient(url, backend="vllm") as client:
            await Publisher("filesystem", tokenizer, tmp_path)(client, v0, 0)
            long = asyncio.create_task(client.generate(long_request))
            await asyncio.sleep(SETTLE_S)
            rpc = {"method": "sao_reload_weights", "kwargs": {"path": str(v1_dir)}}
            async with httpx.AsyncClient(base_url=url, timeout=60) as raw:
                (await raw.post("/collective_rpc", json=rpc)).raise_for_status()
                reset = (await raw.post("/reset_prefix_cache")).json()
                assert not long.done(), "the long request ended before the reload: make it longer"
                result = await long
                (await raw.post("/reset_prefix_cache")).raise_for_status()
            return result, reset

    result, reset = asyncio.run(main())
    assert reset == {"success": False}  # blocks held by the running request
    ids = torch.tensor([result.prompt_ids + result.token_ids])
    got = torch.tensor(result.logprobs)
    off = [(got - token_logprobs(m, ids, 1.0)[0, len(result.prompt_ids) :]).abs() for m in (v0, v1)]
    switched = int((off[0] > 1e-3).nonzero()[0])  # the first token not sampled by v0
    print(f"reload under a running request: tokens 0..{switched - 1} of {LONG} from v0, the rest from neither")
    assert 0 < switched < LONG and result.finish_reason == "length"
    assert off[0][:switched].max() < 1e-4
    assert off[0][switched:].max() > 1e-2 and off[1][switched:].max() > 1e-3


def test_collective_transport_brings_two_vllm_servers_to_each_version(dense, tokenizer, tmp_path):
    """`HttpRollouts` with `server="vllm"`, `weight_transfer="collective"` (the filesystem fallback on, as by
    default), its probe after every version: both servers sample exactly the trainer's weights after v0, v1 and v2,
    the pool's clients tag every token with the version, every byte went over the groups, and no directory was
    written.
    Before v2 another client takes server 0's group (a worker holds one): the transfer to it is refused (409),
    retried once on a new group, and succeeds."""
    v0 = dense.models[0]
    published = tmp_path / "published"
    state_bytes = sum(t.numel() * t.element_size() for t in v0.state_dict().values())
    probes = requests(tokenizer, 1.0, n=4, max_tokens=32)
    log: list[str] = []

    async def main():
        rc = RolloutConfig(
            backend="http",
            urls=tuple(dense.urls),
            server="vllm",
            weight_transfer="collective",
            transfer_bucket_mb=1,
            probe_every=1,
            probe_tolerance=1e-4,
        )
        rollouts = HttpRollouts(rc, v0, tokenizer, published, log=log.append)
        seen = []
        try:
            await rollouts.start()
            for version, model in enumerate(dense.models):
                if version == 2:
                    await _take_group(dense.urls[0])
                if version:
                    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
                    await rollouts.publish(weights, version)
                for server in rollouts.engine.servers:
                    results = await asyncio.gather(*(server.client.generate(r) for r in probes))
                    seen.append((version, server.url, results))
                metrics = rollouts.metrics()
                print(
                    f"v{version}: transfer {metrics['rollout/transfer_s'] * 1e3:.0f} ms, "
                    f"{metrics['rollout/publish_bytes']:.0f} bytes"
                )
                if version:
                    assert metrics["rollout/publish_bytes"] == 2 * state_bytes  # every tensor once per server
        finally:
            await rollouts.close()
        return seen, metrics

    seen, metrics = asyncio.run(main())
    assert not [line for line in log if "failed" in line or "taken out" in line], log  # no fallback, no probe failure
    for version, url, results in seen:
        model, others = dense.models[version], [m for v, m in enumerate(dense.models) if v != version]
        assert all(r.versions == [version] * len(r.token_ids) for r in results), url
        assert logprob_gap(model, results, 1.0) < 1e-4, (version, url)
        assert all(logprob_gap(other, results, 1.0) > 1e-2 for other in others), (version, url)
    assert metrics["rollout/transfer_fallbacks"] == 0 and metrics["rollout/transfer_retries"] == 1
    assert metrics["rollout/probe_failures"] == 0 and metrics["rollout/probe_max_abs_diff"] < 1e-4
    assert metrics["rollout/engines_live"] == 2 and metrics["rollout/engine_errors"] == 0
    assert not published.exists()


def test_a_tensor_parallel_vllm_takes_each_version_on_both_workers_from_two_senders(tokenizer, tmp_path):
    """A vLLM of two tensor-parallel workers (`--tensor-parallel-size 2`) and every rank sending: rank 0's transport
    and a follower sender (a thread standing for rank 1) each send their buckets, and both of the server's workers
    join each sender's group and receive every bucket, each loading its own shard. The server samples exactly the
    trainer's weights after v1 and v2 (its probe and this test's), and nothing went through the filesystem."""
    model = dense_qwen3(tokenizer)
    versions = [model, perturbed(model, 1), perturbed(model, 2)]
    published = tmp_path / "published"
    model_dir = save_model_dir(model, tokenizer, tmp_path / "v0")
    probes = requests(tokenizer, 1.0, n=4, max_tokens=32)
    log: list[str] = []

    async def main(url: str):
        rc = RolloutConfig(
            backend="http",
            urls=(url,),
            server="vllm",
            weight_transfer="collective",
            transfer_senders="all",
            transfer_bucket_mb=1,  # 1.2 MB: a bucket from each sender
            probe_every=1,
            probe_tolerance=1e-4,
        )
        rollouts = HttpRollouts(rc, model, tokenizer, published, log=log.append, senders=2)
        seen, follower = [], None
        try:
            await rollouts.start()
            for version, state in enumerate(versions[1:], start=1):
                weights = {name: t.detach().clone() for name, t in state.state_dict().items()}
                share = rollouts.share(version)
                follower = follower or FollowerSender(1, share)
                follower.stage(share, weights)
                share.staged = True  # what the learner's gather says once every follower has staged it
                await rollouts.publish(weights, version)
                client = rollouts.engine.servers[0].client
                results = await asyncio.gather(*(client.generate(r) for r in probes))
                seen.append((version, rollouts.metrics()["rollout/transfer_senders"], results))
            return seen, share, rollouts.metrics()
        finally:
            await rollouts.close()
            if follower is not None:
                follower.close()

    with VLLMServer(model_dir, tmp_path / "vllm-tp2.log", tensor_parallel=2) as url:
        seen, share, metrics = asyncio.run(main(url))
    assert not [line for line in log if "failed" in line or "taken out" in line], log  # no fallback, no probe failure
    assert len(share.buckets) == 2
    for version, senders, results in seen:
        others = [m for v, m in enumerate(versions) if v != version]
        assert senders == 2.0, version
        assert all(r.versions == [version] * len(r.token_ids) for r in results), version
        assert logprob_gap(versions[version], results, 1.0) < 1e-4, version
        assert all(logprob_gap(other, results, 1.0) > 1e-2 for other in others), version
    assert metrics["rollout/transfer_fallbacks"] == 0 and metrics["rollout/transfer_retries"] == 0
    assert metrics["rollout/probe_failures"] == 0 and metrics["rollout/probe_max_abs_diff"] < 1e-4
    assert not published.exists()


async def _take_group(url: str) -> None:
    """Form a transfer group with the server at `url` from another trainer-side `Sender` (a client of its own)."""
    sender = Sender()
    request = sender.request(url)
    async with EngineClient(url, backend="vllm") as other:
        join = asyncio.create_task(other.join_group(request.model_dump()))
        await asyncio.to_thread(sender.form, url, request)
        assert (await join)["transfer_group"] == request.group


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "vllm", "-q", "-s"]))
