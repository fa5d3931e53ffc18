"""`rollout.sandbox_degraded`: a run whose config refuses a degraded sandbox stops as its environment is set up,
with one line naming the field and the sandbox's reason; one that allows it runs its tool calls degraded and says
so in its log.

Namespaces are taken away the way a container without CAP_SYS_ADMIN takes them: a child process whose capability
bounding set lacks CAP_SYS_ADMIN (`setpriv`), so the sandbox's own `unshare` probe is refused. A test process that is
not root runs the child as it is: it is degraded already ("caller is not root"). Nothing of the sandbox is patched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from components.config import load_config
from components.envs.registry import build_env
from components.sandbox import degraded_reason
from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0

needs_a_way_to_degrade = pytest.mark.skipif(
    IS_ROOT and shutil.which("setpriv") is None, reason="as root, setpriv (util-linux) drops CAP_SYS_ADMIN"
)


def without(caps: str, script: str, *args: str) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter whose bounding set lacks `caps` (setpriv syntax: "-sys_admin"); as it is
    when this process is not root."""
    prefix = ["setpriv", "--bounding-set", caps, "--"] if IS_ROOT else []
    return subprocess.run(
        [*prefix, sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=child_env(),
    )


# A GPU training run as the flow runs it (`run_train` with the preset), on a host without the sandbox's namespaces.
_GPU_RUN = """
import sys
from pathlib import Path
from components.config import load_config
from components.sandbox import degraded_reason
from components.stages.train import run_train
print(degraded_reason())
try:
    run_train(load_config("qwen3-30b-a3b"), Path(sys.argv[1]))
except ValueError as exc:
    print(type(exc).__name__)
    print(exc)
"""


@needs_a_way_to_degrade
def test_a_gpu_run_refuses_a_degraded_sandbox_before_anything_starts(tmp_path):
    home = tmp_path / "home"
    done = without("-sys_admin", _GPU_RUN, str(home))
    assert done.returncode == 0, done.stderr[-3000:]
    reason, kind, message = done.stdout.splitlines()
    # The reason is the sandbox's own: its unshare probe refused (root without CAP_SYS_ADMIN), or not root.
    assert reason.startswith("unshare probe failed" if IS_ROOT else "caller is not root"), reason
    assert kind == "SandboxRefused"
    assert message.startswith(
        f'rollout.sandbox_degraded = "refuse": the sandbox cannot seal model-written code here ({reason})'
    )
    assert 'rollout.sandbox_degraded = "warn" to run it degraded' in message
    assert not home.exists()  # refused before the SFT policy, the tracker or a checkpoint


# tiny-cpu (tir_math, the default "warn"): the environment is built, its Python tool runs, and the log says why the
# sandbox is degraded. Style runs no model-written code, so even "refuse" builds it.
_WARN_RUN = """
import json, warnings
from components.config import load_config
from components.envs.registry import build_env
lines = []
setup = build_env(load_config("tiny-cpu"), lines.append)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    observation = setup.env.tool("print(6 * 7)")
style = build_env(load_config("tiny-cpu", ['env.name="style"', 'rollout.sandbox_degraded="refuse"']), lines.append)
print(json.dumps({"lines": lines, "observation": observation, "warnings": [str(w.message) for w in caught],
                  "style": style.name}))
"""


@needs_a_way_to_degrade
def test_warn_runs_the_tool_degraded_and_logs_the_field():
    done = without("-sys_admin", _WARN_RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["observation"] == "42\n"
    assert len(out["lines"]) == 1, out["lines"]
    line = out["lines"][0]
    assert line.startswith("sandbox: DEGRADED (")
    assert 'as rollout.sandbox_degraded = "warn" allows' in line
    assert [w for w in out["warnings"] if "SAO sandbox is DEGRADED" in w], out["warnings"]
    assert out["style"] == "style"


# A container that allows unshare but not the rest of the seal: here, no CAP_SETUID/CAP_SETGID, so every call fails
# at the drop to nobody. The probe passes; the proving call of "refuse" finds it at start.
_BROKEN_SEAL = """
from components.config import load_config
from components.envs.registry import build_env
from components.sandbox import degraded_reason
print(degraded_reason())
try:
    build_env(load_config("tiny-cpu", ['rollout.sandbox_degraded="refuse"']), print)
except ValueError as exc:
    print(type(exc).__name__)
    print(exc)
"""


@pytest.mark.skipif(not IS_ROOT or shutil.which("setpriv") is None, reason="needs root and setpriv")
@pytest.mark.skipif(degraded_reason() is not None, reason="namespaces unavailable on this host")
def test_refuse_proves_one_sealed_call_at_start():
    done = without("-setuid,-setgid", _BROKEN_SEAL)
    assert done.returncode == 0, done.stderr[-3000:]
    reason, kind, message = done.stdout.splitlines()
    assert reason == "None"  # the namespaces are there ...
    assert kind == "SandboxRefused"  # ... but a call cannot drop to nobody
    assert message.startswith('rollout.sandbox_degraded = "refuse": the sandbox cannot seal model-written code here')
    assert "cannot drop privileges" in message


@pytest.mark.skipif(degraded_reason() is not None, reason="namespaces unavailable on this host")
def test_refuse_on_a_sealed_host_builds_the_environment_and_logs_nothing():
    lines: list[str] = []
    setup = build_env(load_config("tiny-cpu", ['rollout.sandbox_degraded="refuse"']), lines.append)
    assert (setup.name, lines) == ("tir_math", [])
    assert setup.env.tool(f"import os; print(os.path.exists({str(ROOT)!r}))") == "False\n"  # the sealed root
