"""Environments from outside the repository: the walkthrough's factory (docs/environments.md), written to a
temporary directory on PYTHONPATH, is trained by `sao train --set env.entrypoint=...` from an existing policy and
evaluated by `sao eval`; bad entry points end with one `sao:` line naming what was wrong."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from components.config import load_config
from components.contracts.environment import EnvSetup
from components.envs.registry import EnvFactoryError, build_env
from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[2]


def walkthrough() -> str:
    """The code block under `<!-- walkthrough: my_env.py -->` in docs/environments.md, as it is."""
    text = (ROOT / "docs" / "environments.md").read_text()
    block = re.search(r"<!-- walkthrough: my_env.py -->\n```python\n(.*?)```", text, re.S)
    assert block, "docs/environments.md lost its walkthrough block"
    return block.group(1)


def test_the_walkthrough_is_under_60_lines():
    code = [line for line in walkthrough().splitlines() if line.strip()]
    assert len(code) < 60


@pytest.fixture
def outside(tmp_path, monkeypatch) -> Path:
    """A directory outside the repository, on this process's sys.path (and PYTHONPATH for subprocesses)."""
    directory = tmp_path / "user_code"
    directory.mkdir()
    monkeypatch.syspath_prepend(str(directory))
    return directory


def write_module(directory: Path, name: str, code: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(code))
    sys.modules.pop(name, None)


def test_the_walkthrough_factory_builds_a_checked_setup(outside):
    write_module(outside, "my_env", walkthrough())
    cfg = load_config("tiny-cpu", ['env.entrypoint="my_env:factory"', "env.options.size=7"])
    assert cfg.env.name == "my_env"  # the module's name labels the run
    setup = build_env(cfg, log=lambda _: None)
    assert isinstance(setup, EnvSetup) and setup.name == "my_env" and setup.sandboxed
    tasks = list(zip(range(9), setup.train_tasks(0, 1)))
    assert [t.task_id.split("@")[1] for _, t in tasks] == [str(i) for i in range(9)]  # cycled: 7 then epoch 2
    assert {t.task_id.split("@")[0] for _, t in tasks[:7]} == {f"train-{i}" for i in range(7)}
    first = tasks[0][1]
    a, b, c = map(int, re.fullmatch(r"Compute (\d+)\*(\d+)-(\d+)\.", first.prompt).groups())
    assert first.answer == a * b - c
    assert len(setup.eval_tasks()) == 24 and setup.tools[0]["function"]["name"] == "python"


def sao(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "components.cli", *args], capture_output=True, text=True, timeout=900, env=env
    )


SMALL = [
    "--set",
    "value_pretrain.episodes=4",
    "--set",
    "value_pretrain.max_epochs=1",
    "--set",
    'train.backend="torch"',
    "--set",
    "train.batch_size=2",
    "--set",
    "rollout.concurrency=2",
    "--set",
    'tracking.backend="disk"',
    "--set",
    'env.entrypoint="my_env:factory"',
    "--set",
    "env.options.size=16",
    "--set",
    "env.options.eval_size=4",
]


def test_a_factory_outside_the_repository_is_trained_and_evaluated(outside, tmp_path, sft_dir, prefect_env):
    write_module(outside, "my_env", walkthrough())
    env = {**prefect_env, "PYTHONPATH": f"{outside}:{ROOT}"}
    home = tmp_path / "home"
    trained = sao("train", "--preset", "tiny-cpu", "--home", str(home), "--policy", str(sft_dir), "--max-steps", "2",
                  *SMALL, env=env)  # fmt: skip
    out = trained.stdout + trained.stderr
    assert trained.returncode == 0, out[-3000:]
    assert f"sft: starting from the given policy {sft_dir}" in out
    assert f"train: starts from the policy {sft_dir}" in out
    assert re.search(r"train: held-out accuracy \d+\.\d% -> \d+\.\d% after 2 policy versions", out), out[-2000:]
    assert not (home / "models" / "sft-my_env").exists()  # no SFT ran for it
    # the same config as the run (sft.policy included: checkpoints are rebuilt on the policy they started from)
    evaluated = sao("eval", "--preset", "tiny-cpu", "--home", str(home), "--set", f'sft.policy="{sft_dir}"', *SMALL,
                    env=env)  # fmt: skip
    out = evaluated.stdout + evaluated.stderr
    assert evaluated.returncode == 0, out[-3000:]
    assert re.search(r"eval: 4 my_env-heldout tasks x 1 sample\(s\)", out), out[-2000:]
    assert "step-2" in out, out[-2000:]  # the run's newest checkpoint, not the starting policy


BAD = {
    "missing module": ("no_such_module_xyz:factory", None, "cannot import 'no_such_module_xyz'"),
    "missing attribute": ("bad_env:nothing", "def factory(options):\n    return 1\n", "has no attribute 'nothing'"),
    "wrong type": (
        "bad_env:factory",
        "def factory(options):\n    return [1, 2]\n",
        "returned a list, expected an EnvSetup",
    ),
    "factory raises": (
        "bad_env:factory",
        "def factory(options):\n    raise KeyError('size')\n",
        "the factory failed: KeyError: 'size'",
    ),
    "task without a prompt": (
        "bad_env:factory",
        """
        from components.contracts.environment import EnvSetup
        from components.contracts.task import Task

        class Env:
            name, success_threshold = "bad", 1.0
            def start(self, task): ...

        def factory(options):
            return EnvSetup("bad", Env(), [Task("t0", "Compute 1+1.", 2), Task("t1", "  ", 0)], [])
        """,
        "training task 1 (t1) has no prompt",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_entry_point_is_refused_in_process(case, outside):
    spec, code, message = BAD[case]
    if code is not None:
        write_module(outside, "bad_env", code)
    with pytest.raises(EnvFactoryError) as info:
        build_env(load_config("tiny-cpu", [f'env.entrypoint="{spec}"']), log=lambda _: None)
    assert str(info.value).startswith(f"env.entrypoint {spec!r}: ") and message in str(info.value)


@pytest.mark.parametrize("case", ["missing module", "wrong type", "task without a prompt"])
def test_a_bad_entry_point_ends_the_command_with_one_sao_line(case, outside, tmp_path):
    spec, code, message = BAD[case]
    if code is not None:
        write_module(outside, "bad_env", code)
    env = child_env(PYTHONPATH=f"{outside}:{ROOT}")
    model = tmp_path / "model"  # the environment is refused before any model is read
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_text("{}")
    args = ["--home", str(tmp_path), "--model", str(model), "--out", str(tmp_path / "out.parquet")]
    done = sao("rollout", "--preset", "tiny-cpu", *args, "--set", f'env.entrypoint="{spec}"', env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"sao: env.entrypoint {spec!r}: ") and message in lines[0]


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(EnvFactoryError) as info:
        build_env(load_config("tiny-cpu", ['env.name="chess"']), log=lambda _: None)
    assert "no environment 'chess' in the 'sao.environments' entry-point group" in str(info.value)
    assert "['coding', 'style', 'tir_math', 'verifiers']" in str(info.value)
