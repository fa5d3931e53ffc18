"""Shared fixtures: one briefly-trained tiny policy for the tests that need a model that can do the task."""

import shutil
from pathlib import Path

import pytest

from components.chat import MarkerFormat
from components.config import load_config
from components.data.tasks import generate_problems
from components.data.teacher import teacher_trace
from components.models import build_policy, build_tokenizer, save_model_dir
from components.stages.sft import sft_recipe
from components.storage import atomic_dir, write_json
from components.training.engines.loading import open_engine
from components.training.engines.settings import EngineSettings
from components.training.sft import train_sft


@pytest.fixture(scope="session")
def tiny_cfg():
    return load_config(
        "tiny-cpu",
        [
            "sft.steps=200",
            "sft.batch_size=32",
            "sft.warmup_steps=20",
            "sft.log_every=1000",
            "task.train_size=2000",
            "task.eval_size=24",
        ],
    )


@pytest.fixture(scope="session")
def sft_policy(tiny_cfg):
    """A tiny policy after 200 SFT steps (~20 s): it calls the tool and answers, though not always correctly."""
    tokenizer = build_tokenizer()
    model = build_policy(tiny_cfg.model, tokenizer, seed=0)
    problems = generate_problems(tiny_cfg.task.kinds, tiny_cfg.task.train_size, 0, 99, "train")
    engine = open_engine(EngineSettings.sft(tiny_cfg), None, model)  # SFT's torch engine, as `sao sft` builds it
    train_sft(engine, MarkerFormat(tokenizer), [teacher_trace(p) for p in problems], tiny_cfg.sft, log=lambda _: None)
    return model, tokenizer


@pytest.fixture
def engine(sft_policy):
    """The embedded engine on a copy of the test policy (the agent and evaluation tests sample from it)."""
    import copy

    from components.rollout.embedded import EmbeddedEngine

    model, tokenizer = sft_policy
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_batch=16).start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def moto_endpoint():
    """moto's threaded S3 server on a free loopback port: a real HTTP endpoint every process can reach."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(moto_endpoint, monkeypatch):
    """The AWS environment of a process talking to the moto server (also inherited by subprocesses)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    return moto_endpoint


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect test harness for the session (a temporary database and API server, ~11 s to start): flows run
    against it in this process, and subprocesses reach it through `PREFECT_API_URL` (`prefect_env`)."""
    import flows  # noqa: F401  (offline settings before prefect is imported)

    # isort: split
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What `init_single_process_group` sets in this process when a test trains in process: a subprocess that
inherited them would take itself for a rank of this process's group (and its port is taken)."""


def free_port() -> int:
    """A loopback port nothing listens on now (for a server a test starts)."""
    from components.rollout.engine_process import free_port as free

    return free()


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a subprocess, without the torch.distributed variables of this process."""
    import os

    return {**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, **extra}


@pytest.fixture
def prefect_env(prefect_api):
    """The environment of a subprocess that runs flows against the session's harness."""
    return child_env(PREFECT_API_URL=prefect_api)


@pytest.fixture(scope="session")
def sft_dir(sft_policy, tmp_path_factory):
    model, tokenizer = sft_policy
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("sft") / "policy")


@pytest.fixture
def seeded_home(tmp_path: Path, sft_dir: Path) -> Path:
    """A run home whose SFT step reuses the test policy (saved with the preset's recipe) instead of training."""
    home = tmp_path / "home"
    with atomic_dir(home / "models" / "sft-tir_math") as tmp:
        shutil.copytree(sft_dir, tmp, dirs_exist_ok=True)
        write_json(tmp / "sao_sft.json", {"recipe": sft_recipe(load_config("tiny-cpu"))})
    return home
