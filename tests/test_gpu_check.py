"""The GPU check (bench/gpu_check.py) on its CPU path, where a bare GPU machine would run it: a Python that sees only
torch, transformers, accelerate, deepspeed and pydantic (and what they require), not Prefect, MLflow, vLLM, pyarrow,
boto3 or an HTTP client. Its figures are not measurements here; that every check runs, records its figure and
threshold, and fails when it should, is what is checked."""

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest

from bench.gpu_check import carried, main, version_checks
from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[1]
GPU_MACHINE = ("torch", "transformers", "accelerate", "deepspeed", "pydantic")
"""What the GPU machine has or is given as wheels (docs/gpu.md, "The GPU check"), with their requirements."""
NOT_THERE = ("prefect", "mlflow", "vllm", "pyarrow", "boto3", "httpx", "fastapi", "great_expectations", "pandas")
STAGE_CHECKS = ("bad_steps", "policy_moved", "critic_moved", "dis_dropped", "peak_gb", "mfu")
LOGPROB_CHECKS = ("bf16_vs_fp32_mean", "bf16_vs_fp32_max", "engine_vs_trainer_mean")


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


def bare_site() -> Path:
    """A site directory holding links to the files of the GPU machine's distributions only, at a path named by its
    links and reused: DeepSpeed compiles its CPU comm op on first use with include paths under the site, which
    torch's build cache keys on, so a fresh path each run would compile it again (~45 s). Its build goes to a cache
    of its own beside the site (`TORCH_EXTENSIONS_DIR`), or the venv's build and this one would evict each other."""
    links: dict[str, Path] = {}
    for dist_name in sorted(set().union(*(_requirements(n) for n in GPU_MACHINE))):
        dist = metadata.distribution(dist_name)
        for top in sorted({Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}):
            if Path(dist.locate_file(top)).exists():
                links.setdefault(top, Path(dist.locate_file(top)))
    digest = hashlib.sha256(repr(sorted((k, str(v)) for k, v in links.items())).encode()).hexdigest()[:12]
    site = Path(tempfile.gettempdir()) / f"sao-gpu-check-{digest}" / "site"
    if not site.exists():
        site.parent.mkdir(exist_ok=True)
        building = Path(tempfile.mkdtemp(dir=site.parent))  # filled, then renamed into place whole
        for top, source in links.items():
            (building / top).symlink_to(source)
        try:
            building.rename(site)
        except OSError:  # a run beside this one put it there first
            shutil.rmtree(building)
    return site


def run_check(*args: str) -> subprocess.CompletedProcess:
    """`python -m bench.gpu_check --cpu ARGS` in this venv, one thread."""
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--cpu", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"),
        cwd=REPO,
    )


def checks_of(figures: dict) -> dict[str, dict]:
    return {c["name"]: c for c in figures["checks"]}


def test_the_gpu_check_runs_its_cpu_path_with_only_the_gpu_machines_packages(tmp_path):
    site = bare_site()
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
        env=child_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(site.parent / "torch")),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["ok"] and figures["finished"] and figures["error"] is None
    assert [s["zero_stage"] for s in figures["stages"]] == [0, 3]
    assert {s["dtype"] for s in figures["stages"]} == {"bfloat16"}  # the GPU's dtype, ZeRO-3 with the critic too
    checks = checks_of(figures)
    expected = [f"version/{n}" for n in GPU_MACHINE] + [f"logprobs/{n}" for n in LOGPROB_CHECKS]
    expected += [f"zero{z}/{n}" for z in (0, 3) for n in STAGE_CHECKS]
    assert sorted(checks) == sorted(expected)
    for name, check in checks.items():
        assert check["threshold"] is not None and check["relation"] in ("<=", ">=", "in"), name
        # Memory and MFU are reported on the host, not judged; every other check is judged, and passed.
        assert check["judged"] == (name.split("/")[1] not in ("peak_gb", "mfu")), name
        assert check["ok"] or not check["judged"], check
        assert f"{'pass' if check['judged'] else 'reported'} {name}:" in " ".join(done.stdout.split()), name
    # Every trainable weight of either model moved but the few a later step moved back (1.0 would be all).
    assert all(0.9 <= checks[f"zero{z}/{m}_moved"]["measured"] <= 1 for z in (0, 3) for m in ("policy", "critic"))
    assert checks["zero3/bad_steps"]["measured"] == 0 and checks["zero3/dis_dropped"]["measured"] == 0
    # The host has no device memory: no figure, and the limit is the plan's allocator peak plus 10% (its whole peak
    # adds a fragmentation reserve that torch's allocated bytes do not count).
    for z in (0, 3):
        peak, stage = checks[f"zero{z}/peak_gb"], figures["stages"][z // 3]
        assert peak["measured"] is None and peak["threshold"] == pytest.approx(stage["planned_allocated_gb"] * 1.1)
        assert 0 < stage["planned_allocated_gb"] < stage["planned_peak_gb"]
        assert checks[f"zero{z}/mfu"]["measured"] == pytest.approx(stage["model_tflops_per_s"] * 1e12 / 989e12)
    # bf16 rounds a log-prob by a few 2^-8 steps of the tiny model's small logits: well inside 30 x 2^-9 on average.
    assert 0 < checks["logprobs/bf16_vs_fp32_mean"]["measured"] < checks["logprobs/bf16_vs_fp32_max"]["measured"]
    assert checks["logprobs/bf16_vs_fp32_mean"]["threshold"] == 30 * 2**-8 / 2 == 0.05859375
    assert "gpu-check: every check passed" in done.stdout


def test_a_check_past_its_threshold_fails_the_run(tmp_path):
    out = tmp_path / "figures.json"
    # bf16 and fp32 log-probs differ somewhere (a bf16 logit rounds by up to 2^-8 of itself): a threshold of 0 fails.
    done = run_check("--stages", "0", "--threshold", "bf16_vs_fp32_mean=0", "--out", str(out))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["finished"] and figures["error"] is None and not figures["ok"]
    failed = [name for name, c in checks_of(figures).items() if c["judged"] and not c["ok"]]
    assert failed == ["logprobs/bf16_vs_fp32_mean"]
    check = checks_of(figures)["logprobs/bf16_vs_fp32_mean"]
    assert check["threshold"] == 0 and check["measured"] > 0
    assert "FAIL     logprobs/bf16_vs_fp32_mean" in done.stdout
    assert "gpu-check: FAILED: logprobs/bf16_vs_fp32_mean" in done.stdout


def test_the_json_holds_the_first_stage_when_a_later_one_raises(tmp_path):
    out = tmp_path / "figures.json"
    # ZeRO has stages 0-3: the config refuses 4 as that stage starts, after ZeRO-0 ran and was written.
    done = run_check("--stages", "0,4", "--out", str(out))
    assert done.returncode != 0 and "train.zero_stage" in done.stderr, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert not figures["finished"] and not figures["ok"]
    assert figures["error"].startswith("ZeRO-4: ") and "zero_stage" in figures["error"]
    assert [s["zero_stage"] for s in figures["stages"]] == [0]
    checks = checks_of(figures)
    assert {f"zero0/{n}" for n in STAGE_CHECKS} | {f"logprobs/{n}" for n in LOGPROB_CHECKS} <= set(checks)
    assert not any(name.startswith("zero4/") for name in checks)
    assert not out.with_name(out.name + ".tmp").exists()  # written whole, then moved into place


def _pins(tmp_path: Path, **pins: str) -> Path:
    """A pyproject.toml with the project's dependencies but `pins` (name -> specifier) in place of theirs."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    deps = [d for d in deps if re.split(r"[\s;<>=!~\[(]", d)[0] not in pins] + [n + s for n, s in pins.items()]
    path = tmp_path / "pyproject.toml"
    path.write_text("[project]\ndependencies = [" + ", ".join(json.dumps(d) for d in deps) + "]\n")
    return path


def test_a_transformers_below_the_pin_stops_the_check_naming_both_versions(tmp_path):
    installed = metadata.version("transformers")
    out = tmp_path / "figures.json"
    with pytest.raises(SystemExit) as stopped:
        main(["--cpu", "--pyproject", str(_pins(tmp_path, transformers="==5.17.0")), "--out", str(out)])
    assert f"transformers {installed} is installed, pyproject.toml pins transformers==5.17.0" in str(stopped.value)
    figures = json.loads(out.read_text())  # written before anything ran
    assert not figures["ok"] and figures["stages"] == [] and "transformers" in figures["error"]
    check = checks_of(figures)["version/transformers"]
    assert (check["measured"], check["threshold"], check["ok"]) == (installed, "==5.17.0", False)


def test_accept_torch_passes_only_the_named_torch(tmp_path):
    public = metadata.version("torch").split("+")[0]  # "2.13.0+cpu" -> "2.13.0"
    pinned = _pins(tmp_path, torch="==2.11.0")  # as if the pin were another release than the one installed
    assert not version_checks(pinned)[0].ok
    assert not version_checks(pinned, accept_torch="2.12.0")[0].ok
    accepted = version_checks(pinned, accept_torch=public)[0]
    assert accepted.ok and accepted.name == "version/torch" and f"--accept-torch {public}" in accepted.why
    assert all(c.ok for c in version_checks(REPO / "pyproject.toml"))  # this venv meets the pins


def test_gpu_wheels_carries_the_pinned_transformers_and_not_torch():
    wheels = carried()
    for name in ("transformers", "accelerate", "deepspeed", "pydantic", "huggingface-hub", "tokenizers"):
        assert wheels[name] == metadata.version(name), name
    assert "torch" not in wheels and "numpy" not in wheels  # the GPU image's own; torch's CUDA wheel is GBs
    assert "tomli" not in wheels  # required only below Python 3.11: markers are read for the GPU's 3.12
