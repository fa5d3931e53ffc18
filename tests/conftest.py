"""Shared fixtures: one briefly-trained tiny policy for the tests that need a model that can do the task."""

import pytest

from components.config import load_config
from components.data.tasks import generate_problems
from components.data.teacher import teacher_trace
from components.models import build_policy, build_tokenizer
from components.training.sft import train_sft


@pytest.fixture(scope="session")
def tiny_cfg():
    return load_config("tiny-cpu", ["sft.steps=200", "sft.batch_size=32", "sft.warmup_steps=20",
                                    "sft.log_every=1000", "task.train_size=2000", "task.eval_size=24"])


@pytest.fixture(scope="session")
def sft_policy(tiny_cfg):
    """A tiny policy after 200 SFT steps (~20 s): it calls the tool and answers, though not always correctly."""
    tokenizer = build_tokenizer()
    model = build_policy(tiny_cfg.model, tokenizer, seed=0)
    problems = generate_problems(tiny_cfg.task.kinds, tiny_cfg.task.train_size, 0, 99, "train")
    train_sft(model, tokenizer, [teacher_trace(p) for p in problems], tiny_cfg.sft, log=lambda _: None)
    return model, tokenizer
