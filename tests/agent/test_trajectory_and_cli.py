"""The trajectory contract's validation, and `sao rollout` end to end."""

import math
import subprocess
import sys

import pytest

from components.contracts.trajectory import read_trajectories, to_tensors
from components.models import save_model_dir
from tests.factories import trajectory as _traj


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"action_mask": [0, 0, 1, 0]}, "action_mask has 4 entries, token_ids has 5"),
        ({"rollout_logprobs": [None, None, None, None, -1.0]}, "action token 2 needs a finite log-prob"),
        ({"rollout_logprobs": [None, None, 0.5, None, -1.0]}, "action token 2 needs a finite log-prob <= 0"),
        ({"versions": [None, None, 3, 1, 4]}, "token 3 is not an action"),
        (
            {
                "action_mask": [1, 0, 1, 0, 1],
                "rollout_logprobs": [-1.0, None, -0.5, None, -1.0],
                "versions": [0, None, 3, None, 4],
            },
            "action_mask is 1 inside the prompt",
        ),
        ({"finish_reason": "crashed"}, "finish_reason 'crashed'"),
        ({"reward": math.nan}, "reward must be finite"),
    ],
)
def test_malformed_trajectories_are_rejected_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        _traj(**changes).validate()


def test_tensors_place_the_outcome_reward_on_the_last_action_token():
    batch = to_tensors(
        [
            _traj(),
            _traj(
                token_ids=[5, 6, 7],
                action_mask=[0, 0, 1],
                rollout_logprobs=[None, None, -2.0],
                versions=[None, None, 1],
                reward=0.5,
            ),
        ],
        pad_id=0,
    )
    assert batch["rewards"].tolist() == [[0, 0, 0, 0, 1.0], [0, 0, 0.5, 0, 0]]
    assert batch["versions"].tolist() == [[-1, -1, 3, -1, 4], [-1, -1, 1, -1, -1]]
    assert batch["rollout_logprobs"][0].tolist() == [0, 0, -0.5, 0, -1.0]
    assert batch["attention_mask"][1].tolist() == [1, 1, 1, 0, 0]


def test_sao_rollout_writes_inspectable_parquet(tmp_path, sft_policy):
    model, tokenizer = sft_policy
    model_dir = save_model_dir(model, tokenizer, tmp_path / "sft")
    out = tmp_path / "rollouts.parquet"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "components.cli",
            "rollout",
            "--env",
            "tir_math",
            "--episodes",
            "6",
            "--out",
            str(out),
            "--model",
            str(model_dir),
            "--home",
            str(tmp_path / "home"),
            "--set",
            "rollout.concurrency=3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rollout: 6 tir_math episodes" in result.stdout
    trajectories = read_trajectories(out)
    assert len(trajectories) == 6 and {t.env for t in trajectories} == {"tir_math"}
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "components.cli",
            "rollout",
            "--env",
            "chess",
            "--episodes",
            "1",
            "--out",
            str(out),
            "--model",
            str(model_dir),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "env.name" in bad.stderr and "chess" in bad.stderr
