"""SFT and value pretraining on DeepSpeed (`sft.backend`, `value_pretrain.backend`), in one process and on two gloo
ranks under torchrun (components/stages/ranks.py): the same policy and the same critic."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.models import ValueModel, load_policy
from tests.conftest import child_env

# Two processes against one, each a DeepSpeed start on 2 cores: 1-2 minutes a test, so `make test-ranks` runs them.
pytestmark = pytest.mark.ranks

WORKER = Path(__file__).with_name("ranks_worker.py")
SMALL = [
    "task.train_size=64",
    "task.eval_size=8",
    "sft.steps=3",
    "sft.batch_size=8",
    "sft.lr=3e-4",
    "sft.min_lr=3e-4",
    "sft.warmup_steps=0",
    'sft.backend="deepspeed"',
    "value_pretrain.episodes=24",
    "value_pretrain.batch_size=8",
    "value_pretrain.max_epochs=2",
    "value_pretrain.patience=2",
    'value_pretrain.backend="deepspeed"',
    "train.zero_stage=3",
]
"""A few steps of each, both stages at ZeRO-3 (learning rates low enough that Adam's steps on rounding-level
gradients stay within the weights' tolerance)."""


def _run(home: Path, stage: str, ranks: int) -> dict:
    out = home / f"{stage}.json"
    launcher = [sys.executable] if ranks == 1 else [str(Path(sys.executable).with_name("torchrun")), "--standalone"]
    launcher += [] if ranks == 1 else ["--nproc-per-node", str(ranks)]
    env = child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()))
    done = subprocess.run(
        [*launcher, str(WORKER), str(home), stage, str(out), *SMALL],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([v.flatten().float() for _, v in sorted(state.items())])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, dict]:
    home = tmp_path_factory.mktemp("one")
    return home, _run(home, "value-pretrain", ranks=1)


def test_sft_on_two_ranks_trains_the_one_process_policy(one_process, tmp_path):
    home, single = one_process
    two = _run(tmp_path, "sft", ranks=2)
    a, b = (load_policy(r["sft_dir"]).state_dict() for r in (single, two))
    assert torch.allclose(_flat(a), _flat(b), atol=1e-4), (_flat(a) - _flat(b)).abs().max()
    assert a.keys() == b.keys() and all(v.numel() > 0 for v in b.values())  # gathered whole
    recorded = [json.loads((Path(r["sft_dir"]) / "sao_sft.json").read_text())["result"] for r in (single, two)]
    assert recorded[1]["final_loss"] == pytest.approx(recorded[0]["final_loss"], rel=1e-4)


def test_value_pretraining_on_two_ranks_fits_the_one_process_critic(one_process, tmp_path):
    """The torchrun home starts from the one-process SFT policy (reused by its recipe), so both fit the same
    rollouts: the same held-out explained variances, epoch by epoch, and the same critic."""
    home, single = one_process
    sft = Path(single["sft_dir"])
    shutil.copytree(sft, tmp_path / sft.relative_to(home))
    two = _run(tmp_path, "value-pretrain", ranks=2)
    assert Path(two["sft_dir"]).name == sft.name
    assert two["summary"]["ev_history"] == pytest.approx(single["summary"]["ev_history"], rel=1e-4, abs=1e-5)
    assert two["summary"]["best_epoch"] == single["summary"]["best_epoch"]
    a, b = (ValueModel.load(r["critic"]).state_dict() for r in (single, two))
    assert torch.allclose(_flat(a), _flat(b), atol=1e-4), (_flat(a) - _flat(b)).abs().max()
