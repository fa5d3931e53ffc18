"""Fixtures of the rollout tests: an untrained tiny policy, policy versions to publish, and engines behind real
servers on loopback ports."""

import copy

import pytest
import torch
from fastapi import FastAPI

from components.models import build_policy, build_tokenizer, save_model_dir
from components.rollout.embedded import EmbeddedEngine
from components.rollout.server import ServerThread, create_app


@pytest.fixture(scope="module")
def two_versions(sft_policy, tmp_path_factory):
    """The SFT policy (version 0) and a perturbed copy saved as an HF directory (to publish as version 1)."""
    model, tokenizer = sft_policy
    perturbed = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    path = save_model_dir(perturbed, tokenizer, tmp_path_factory.mktemp("v1") / "policy")
    return model, perturbed, tokenizer, path


@pytest.fixture
def fresh_model(sft_policy):
    """A private copy of the SFT policy (engines load weights into their model in place)."""
    return copy.deepcopy(sft_policy[0]), sft_policy[1]


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    """An untrained tiny policy (version 0) and its tokenizer."""
    tokenizer = build_tokenizer()
    return build_policy(tiny_cfg.model, tokenizer, seed=0), tokenizer


class _Served:
    """An embedded engine behind a real uvicorn server on a loopback port, in this process."""

    def __init__(self, app_or_model, tokenizer=None, port: int = 0) -> None:
        if isinstance(app_or_model, FastAPI):
            self.engine, app = None, app_or_model
        else:
            self.engine = EmbeddedEngine(copy.deepcopy(app_or_model), tokenizer, max_batch=16, threads=1).start()
            app = create_app(self.engine, "tiny")
        self._thread = ServerThread(app, port=port)
        self.url = self._thread.__enter__()
        self.port = int(self.url.rsplit(":", 1)[1])
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.running = False
            self._thread.__exit__(None, None, None)
            if self.engine is not None:
                self.engine.shutdown()


@pytest.fixture
def serve():
    """`serve(model, tokenizer, port=0)` or `serve(app)`: a started server, stopped at teardown."""
    started: list[_Served] = []

    def start(*args, **kwargs) -> _Served:
        started.append(_Served(*args, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()
