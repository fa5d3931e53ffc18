"""Fixtures of the vLLM tests (`make test-vllm`): the character tokenizer and a vLLM server per model dir."""

import pytest

from components.models import build_tokenizer
from tests.vllm.harness import VLLMServer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def vllm_server(tmp_path):
    """`with vllm_server(model_dir) as url:` serves `model_dir` with vLLM; the log is `tmp_path/vllm.log`."""
    return lambda model_dir: VLLMServer(model_dir, tmp_path / "vllm.log")
