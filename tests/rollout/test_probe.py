"""The weights probe at bf16: its statistic (the median |log-prob difference| over 4 x 32 tokens), its tolerance by the
weights' dtype, and a run whose trainer holds bf16 weights while its server computes in another precision, as a
vLLM GPU server and the trainer's host copy do."""

import asyncio
import copy

import pytest
import torch

from components.models import token_logprobs
from components.rollout.backends import HttpRollouts
from components.rollout.probe import PROBE_REQUESTS, PROBE_TOKENS, compare, probe_requests, tolerance_for
from components.rollout.protocol import SamplingResult
from tests.rollout.test_backends import _config, _weights


def test_the_tolerance_follows_the_loosest_dtype_of_the_weights_and_the_config(tiny):
    model, _ = tiny
    fp32 = copy.deepcopy(model)
    fp32.config.dtype = torch.float32
    assert tolerance_for(fp32) == 1e-4
    assert tolerance_for(copy.deepcopy(fp32).to(torch.bfloat16)) == 0.05
    fp32.config.dtype = "bfloat16"  # a vLLM server with --dtype auto serves the config's dtype: bf16
    assert tolerance_for(fp32) == 0.05
    assert tolerance_for(fp32, configured=0.3) == 0.3


def test_the_statistic_is_the_median_over_every_probe_token_and_one_outlier_does_not_fail_it(tiny):
    model, _ = tiny
    requests = probe_requests(model.config.vocab_size)
    assert len(requests) == PROBE_REQUESTS and {r.max_tokens for r in requests} == {PROBE_TOKENS}
    assert len({tuple(r.prompt_ids) for r in requests}) == PROBE_REQUESTS  # four different prompts, the same each run
    assert [r.prompt_ids for r in probe_requests(model.config.vocab_size)] == [r.prompt_ids for r in requests]

    def served(prompt, tokens, offsets, versions):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            exact = token_logprobs(model, ids, 1.0)[0, len(prompt) :]
        return SamplingResult(tokens, (exact + torch.tensor(offsets)).tolist(), versions, "length", prompt)

    # five tokens off by 0.01, 0.02, 0.03, -0.04 and 6.0 (a routing flip): median 0.03, max 6.0
    a = served([3, 4, 5], [6, 7, 8], [0.01, -0.02, 0.03], [2, 2, 2])
    b = served([9, 10], [11, 12], [-0.04, 6.0], [2, 2])
    found = compare("http://s", model, [a, b], version=2)
    assert found.median_abs_diff == pytest.approx(0.03, abs=1e-6)
    assert found.max_abs_diff == pytest.approx(6.0, abs=1e-5)
    assert found.ok(0.05) and not found.ok(0.02)
    assert not compare("http://s", model, [a, b], version=3).ok(1.0)  # tagged with another version


def _bf16_trainer_and_fp32_server(sft_policy):
    """The trainer's weights in bf16, and a server holding the same bf16-rounded weights but computing in fp32: two
    implementations of one model that differ by rounding only (as vLLM's GPU kernels and the host copy do)."""
    model, tokenizer = sft_policy
    trainer = copy.deepcopy(model).to(torch.bfloat16)
    server = copy.deepcopy(trainer).to(torch.float32)
    return trainer, server, tokenizer


def test_a_bf16_run_keeps_its_servers_and_still_catches_a_server_that_loads_nothing(sft_policy, serve, tmp_path):
    trainer, server_model, tokenizer = _bf16_trainer_and_fp32_server(sft_policy)
    a, b = serve(server_model, tokenizer), serve(server_model, tokenizer)
    lines = []
    gen = torch.Generator().manual_seed(1)
    moved = copy.deepcopy(trainer)
    with torch.no_grad():
        for param in moved.parameters():  # version 1: what a few RL steps do to the policy, and more
            param.add_((torch.randn(param.shape, generator=gen) * 0.02).to(param.dtype))

    async def run():
        rc = _config([a.url, b.url], probe_every=1)
        rollouts = HttpRollouts(rc, trainer, tokenizer, tmp_path / "p", log=lines.append)
        await rollouts.start()
        await rollouts.check(0)  # version 0 on both servers: rounding only
        kept = rollouts.metrics()
        b.engine.load_weights(_weights(moved), 0, rewind=True).result()  # b serves other weights as version 0
        await rollouts.check(0)
        after = rollouts.metrics()
        await rollouts.close()
        return kept, after

    kept, after = asyncio.run(run())
    # Rounding alone: a nonzero median, well inside bf16's tolerance; the old rule (the largest difference over 8
    # tokens against 1e-4) took both servers out here and ended the run with WeightsMismatch.
    assert 0 < kept["rollout/probe_median_abs_diff"] < 0.01
    assert kept["rollout/probe_max_abs_diff"] > 1e-4
    assert kept["rollout/probe_failures"] == 0 and kept["rollout/engines_live"] == 2
    # A server with other weights under the right version tag is caught; the other one stays.
    assert after["rollout/probe_failures"] == 1 and after["rollout/engines_live"] == 1
    assert after["rollout/probe_median_abs_diff"] > 0.05
    assert len(lines) == 1 and b.url in lines[0] and "(median; rollout.probe_tolerance = 0.05)" in lines[0]
