"""Fixtures for the training tests: the tiny SFT policy as an HF directory, and run homes seeded with it."""

import shutil
from pathlib import Path

import pytest

from components.models import save_model_dir


@pytest.fixture(scope="session")
def sft_dir(sft_policy, tmp_path_factory):
    model, tokenizer = sft_policy
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("sft") / "policy")


@pytest.fixture
def seeded_home(tmp_path: Path, sft_dir: Path) -> Path:
    """A run home whose SFT step reuses the test policy (saved with the preset's recipe) instead of training."""
    from components.config import load_config
    from components.jobs import sft_recipe
    from components.storage import atomic_dir, write_json

    home = tmp_path / "home"
    with atomic_dir(home / "models" / "sft-policy") as tmp:
        shutil.copytree(sft_dir, tmp, dirs_exist_ok=True)
        write_json(tmp / "sao_sft.json", {"recipe": sft_recipe(load_config("tiny-cpu"))})
    return home
