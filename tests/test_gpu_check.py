"""The GPU check (bench/gpu_check.py) on its CPU path, where a bare GPU machine would run it: a Python that sees only
torch, transformers, accelerate, deepspeed and pydantic (and what they require), not Prefect, MLflow, vLLM, pyarrow,
boto3 or an HTTP client. The figures are not measurements here; that they come out, finite, is what is checked."""

import json
import math
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[1]
GPU_MACHINE = ("torch", "transformers", "accelerate", "deepspeed", "pydantic")
"""What the GPU machine has or is given as wheels (docs/gpu.md, "The GPU check"), with their requirements."""
NOT_THERE = ("prefect", "mlflow", "vllm", "pyarrow", "boto3", "httpx", "fastapi", "great_expectations", "pandas")


def _requirements(name: str) -> set[str]:
    """`name` and every distribution it requires (without extras), transitively, that is installed here."""
    seen, todo = set(), [name]
    while todo:
        dist = re.split(r"[\s;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if dist in seen:
            continue
        try:
            requires = metadata.distribution(dist).requires or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(dist)
        todo += [r for r in requires if "extra ==" not in r]
    return seen


def bare_site(root: Path) -> Path:
    """A site directory holding links to the files of the GPU machine's distributions only."""
    site = root / "site"
    site.mkdir()
    for dist_name in set().union(*(_requirements(n) for n in GPU_MACHINE)):
        dist = metadata.distribution(dist_name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return site


def test_the_gpu_check_runs_its_cpu_path_with_only_the_gpu_machines_packages(tmp_path):
    site = bare_site(tmp_path)
    assert not any((site / name).exists() for name in NOT_THERE)  # the test would prove nothing otherwise
    out = tmp_path / "figures.json"
    code = (
        f"import sys; sys.path[:0] = [{str(site)!r}, {str(REPO)!r}]; import runpy; "
        f"sys.argv = ['gpu_check', '--cpu', '--out', {str(out)!r}]; runpy.run_module('bench.gpu_check', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert [s["zero_stage"] for s in figures["stages"]] == [0, 3]
    for stage in figures["stages"]:
        assert stage["dtype"] == "fp32" and stage["step_s"] > 0 and stage["trainer_tokens_per_s"] > 0
        assert stage["engine_tokens_per_s"] > 0 and stage["planned_peak_gb"] > 0
        assert math.isnan(stage["peak_gb"])  # no device memory on the host
    # The engine's logged log-probs are the trainer's (both fp32 here): the DIS ratio of version 0 is 1.
    assert figures["engine_vs_trainer_mean_abs_log_ratio"] < 1e-4
    assert 0 < figures["logprob_bf16_vs_fp32_mean"] < figures["logprob_bf16_vs_fp32_max"] < 0.1
    assert "ZeRO-0 fp32: step" in done.stdout and "ZeRO-3 fp32: step" in done.stdout
