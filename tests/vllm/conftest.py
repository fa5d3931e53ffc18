"""Fixtures of the vLLM tests (`make test-vllm`): the character tokenizer, a vLLM server per model dir, and servers
shared by a module (each start costs ~40 s): two serving a dense Qwen3 that never stops early, one serving the
tiny Qwen3-MoE. A test that changes a shared server's weights loads the ones it needs first."""

from contextlib import ExitStack
from dataclasses import dataclass

import pytest

from components.config import ModelConfig
from components.models import build_policy, build_tokenizer, save_model_dir
from tests.vllm.harness import VLLMServer, dense_qwen3, never_stopping, perturbed


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def vllm_server(tmp_path):
    """`with vllm_server(model_dir) as url:` serves `model_dir` with vLLM; the log is `tmp_path/vllm.log`."""
    return lambda model_dir: VLLMServer(model_dir, tmp_path / "vllm.log")


@dataclass
class Served:
    urls: list[str]
    models: list
    """Policy versions: `models[0]` is what the servers started from, the others are `perturbed` copies of it."""


def _serve(tmp_path_factory, name: str, model, tokenizer, count: int, versions: int, max_model_len: int = 512):
    base = tmp_path_factory.mktemp(name)
    model_dir = save_model_dir(model, tokenizer, base / "v0")
    models = [model] + [perturbed(model, seed) for seed in range(1, versions)]
    with ExitStack() as stack:
        servers = [
            VLLMServer(model_dir, base / f"vllm-{i}.log", max_model_len) for i in range(count)
        ]  # all start at once
        urls = [stack.enter_context(server) for server in servers]
        yield Served(urls, models)


DENSE_LENGTH = 2048
"""Context of the dense servers: room for a request that runs for seconds (a token takes ~2.5 ms here)."""


@pytest.fixture(scope="module")
def dense(tmp_path_factory, tokenizer):
    """Two vLLM servers of a tiny dense Qwen3 that never samples EOS (`never_stopping`), and three versions."""
    model = never_stopping(dense_qwen3(tokenizer, max_positions=DENSE_LENGTH), tokenizer)
    yield from _serve(tmp_path_factory, "dense", model, tokenizer, 2, 3, DENSE_LENGTH)


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tokenizer):
    """One vLLM server of the tiny Qwen3-MoE (the default policy) and two versions."""
    yield from _serve(tmp_path_factory, "moe", build_policy(ModelConfig(), tokenizer, seed=0), tokenizer, 1, 2)
