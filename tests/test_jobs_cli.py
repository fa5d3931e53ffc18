"""The `sao` CLI and the jobs behind it, on a small config."""

import json
import subprocess
import sys

import pytest

from components.cli import main
from components.jobs import run_eval, run_sft
from components.storage import MARKER, atomic_dir, is_complete


def test_atomic_dir_is_complete_only_after_success(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "ckpt") as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("crash while writing")
    assert not (tmp_path / "ckpt").exists() and list(tmp_path.iterdir()) == []
    with atomic_dir(tmp_path / "ckpt") as tmp:
        (tmp / "whole.bin").write_bytes(b"x")
    assert is_complete(tmp_path / "ckpt") and (tmp_path / "ckpt" / MARKER).exists()


def test_sft_job_saves_reuses_and_evaluates(tmp_path, tiny_cfg):
    from dataclasses import replace

    cfg = replace(tiny_cfg, sft=replace(tiny_cfg.sft, steps=5, warmup_steps=1))
    lines = []
    model_dir = run_sft(cfg, tmp_path, log=lines.append)
    assert is_complete(model_dir) and (model_dir / "tokenizer.json").exists()
    assert json.loads((model_dir / "sao_sft.json").read_text())["result"]["steps"] == 5
    run_sft(cfg, tmp_path, log=lines.append)
    assert any("reusing the complete SFT policy" in line for line in lines)
    report = run_eval(cfg, model_dir, tmp_path, "t")
    saved = json.loads((tmp_path / "reports" / "t.json").read_text())
    assert saved["accuracy"] == report.accuracy and saved["n"] == cfg.task.eval_size


def test_cli_rejects_bad_config_naming_the_field(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", "--set", "sft.stepz=3"])
    assert exc.value.code == 2
    assert "sft.stepz: unknown field" in capsys.readouterr().err


def test_cli_model_init_writes_an_hf_directory(tmp_path):
    out = subprocess.run([sys.executable, "-m", "components.cli", "model", "init", "--out", str(tmp_path / "m")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("m")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "m").iterdir()}


@pytest.fixture(scope="module")
def preset_home(tmp_path_factory):
    """`sao run` on the tiny-cpu preset from scratch (~4 min on 2 cores): the issue-2 acceptance run, and the
    SFT policy the RL acceptance run starts from."""
    home = tmp_path_factory.mktemp("preset-home")
    out = subprocess.run([sys.executable, "-m", "components.cli", "run", "--home", str(home)],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return home


@pytest.mark.slow
def test_make_run_reaches_sixty_percent(preset_home):
    report = json.loads((preset_home / "reports" / "sft-eval.json").read_text())
    assert report["accuracy"] >= 0.6


@pytest.mark.slow
def test_sao_train_gains_ten_points_over_sft(preset_home):
    """The issue-5 acceptance run: `sao train` (preset: 200 async SAO steps on DeepSpeed) from the SFT policy.
    Measured 69.0% -> 83.5% in 2 min 24 s, evaluations included; the time is printed, not asserted."""
    import time

    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "components.cli", "train", "--home", str(preset_home)],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    before = json.loads((preset_home / "reports" / "sft-eval.json").read_text())["accuracy"]
    after = json.loads((preset_home / "reports" / "sao-eval.json").read_text())["accuracy"]
    print(f"sao train: {before:.1%} -> {after:.1%} in {time.perf_counter() - start:.0f} s")
    assert after - before >= 0.10, out.stdout[-3000:]
