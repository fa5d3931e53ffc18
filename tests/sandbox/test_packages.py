"""The allow-listed packages of the sandbox (components/sandbox/packages.py): real sandboxes, no mocks.

A program imports what `packages` allows (numpy and sympy by default, mpmath with sympy), nothing else of
site-packages, and cannot write where they are; both launchers, a second allow-list in the same process, and the
degraded sandbox, which only puts the host directories on `sys.path`.
"""

from __future__ import annotations

import json
import os
import textwrap
import warnings

import pytest

from components.envs.python_tool import PythonTool
from components.sandbox import run as sandbox
from components.sandbox.packages import PACKAGES_ROOT, resolve_packages
from components.sandbox.rootfs import rootfs_plan
from components.sandbox.run import DEFAULT_PACKAGES, SANDBOX_PYTHON, run_python

NS_AVAILABLE = sandbox._namespace_support()[0]
needs_sealed_root = pytest.mark.skipif(
    os.geteuid() != 0 or not NS_AVAILABLE, reason="the sealed root needs root and unshare"
)
# 360 = 2**3 * 3**2 * 5, and 0 + 1 + 2 + 3 = 6.
COMPUTE = "import numpy, sympy\nprint(sympy.factorint(360), numpy.arange(4).sum())"
COMPUTED = "{2: 3, 3: 2, 5: 1} 6\n"


@pytest.fixture(params=["zygote", "per-call"])
def launcher(request, monkeypatch):
    """Each test under both launchers: the pre-started zygote and a fresh interpreter per call."""
    monkeypatch.setattr(sandbox, "ZYGOTE", request.param == "zygote")
    return request.param


@needs_sealed_root
def test_default_packages_import_and_compute(launcher):
    r = run_python(COMPUTE, 5)
    assert (r.stdout, r.exit_code) == (COMPUTED, 0), r.stderr[-2000:]
    assert ("zygote" in r.isolation) == (launcher == "zygote")


@needs_sealed_root
def test_only_the_allowed_packages_and_their_requirements_are_there(launcher):
    # pytest and torch are installed where numpy is (the test runs in that environment): only the allow-list
    # keeps them out.
    assert resolve_packages(SANDBOX_PYTHON, ("pytest",)).entries
    planned = sorted(
        os.path.basename(target)
        for _, target in json.loads(rootfs_plan(SANDBOX_PYTHON, ("numpy", "sympy"))[0])["packages"]
    )
    assert {"numpy", "sympy", "mpmath"} <= set(planned)  # mpmath: sympy's Requires-Dist
    code = textwrap.dedent(
        f"""
        import os
        print(sorted(os.listdir({PACKAGES_ROOT!r})))
        for name in ('pytest', 'torch'):
            try:
                __import__(name)
            except ModuleNotFoundError as e:
                print(type(e).__name__, e.name)
        """
    )
    r = run_python(code, 5)
    listing, pytest_line, torch_line = r.stdout.splitlines()
    assert eval(listing) == planned
    assert (pytest_line, torch_line) == ("ModuleNotFoundError pytest", "ModuleNotFoundError torch")


@needs_sealed_root
def test_package_directories_are_read_only(launcher):
    code = textwrap.dedent(
        """
        import errno, os, sympy
        here = os.path.dirname(sympy.__file__)
        for path in (os.path.join(here, 'x.py'), os.path.join(os.path.dirname(here), 'x.py')):
            try:
                open(path, 'w')
            except OSError as e:
                print(path, errno.errorcode[e.errno])
            else:
                print(path, 'WRITTEN')
        """
    )
    r = run_python(code, 5)
    lines = [line.split() for line in r.stdout.splitlines()]
    assert [path for path, _ in lines] == [f"{PACKAGES_ROOT}/sympy/x.py", f"{PACKAGES_ROOT}/x.py"], r.stderr
    assert all(error in ("EROFS", "EACCES") for _, error in lines), lines
    host_sympy = next(p for p in resolve_packages(SANDBOX_PYTHON, ("sympy",)).entries if p.endswith("/sympy"))
    assert not os.path.exists(os.path.join(host_sympy, "x.py"))


@needs_sealed_root
def test_no_packages_is_the_bare_standard_library(launcher):
    r = run_python(f"import os\nprint(os.path.exists({PACKAGES_ROOT!r}))\nimport numpy", 5, packages=())
    assert r.stdout == "False\n"
    assert r.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'numpy'"


@needs_sealed_root
def test_each_allow_list_gets_its_own_root(launcher):
    # One process, three allow-lists: a zygote (or a per-call root) per list, never the previous one's.
    probe = "import importlib.util as u\nprint([bool(u.find_spec(n)) for n in ('mpmath', 'numpy', 'sympy')])"
    assert run_python(probe, 5, packages=("mpmath",)).stdout == "[True, False, False]\n"
    assert run_python(probe, 5).stdout == "[True, True, True]\n"
    assert run_python(probe, 5, packages=("numpy",)).stdout == "[False, True, False]\n"


@needs_sealed_root
def test_numpy_and_sympy_fit_the_default_limits_with_one_blas_thread(launcher):
    code = textwrap.dedent(
        """
        import os, numpy, sympy
        print(sympy.sympify('2*3'))
        print(numpy.linalg.inv(numpy.array([[2.0, 0.0], [0.0, 4.0]])).tolist())
        print([os.environ[k] for k in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS')])
        print([l.split()[1] for l in open('/proc/self/status') if l.startswith('Threads:')][0])
        """
    )
    r = run_python(code)  # the defaults: 5 s, 256 MiB of address space
    # inv(diag(2, 4)) = diag(1/2, 1/4); a BLAS call, yet no thread besides the main one.
    assert r.stdout == "6\n[[0.5, 0.0], [0.0, 0.25]]\n['1', '1', '1']\n1\n", r.stderr[-2000:]
    assert not r.timed_out and r.wall_s < 5


@pytest.mark.parametrize(
    ("packages", "message"),
    [
        (("sao_no_such_package",), f"packages: 'sao_no_such_package' is not installed in {SANDBOX_PYTHON}"),
        (("numpy", "sao_no_such_package"), "packages: 'sao_no_such_package' is not installed"),
        ("numpy", "packages must be a tuple of str"),
        (["numpy"], "packages must be a tuple of str"),
        (("numpy.linalg",), "packages: 'numpy.linalg' is not a top-level import name"),
    ],
)
def test_bad_packages_raise_value_error_naming_them(packages, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        run_python("print(1)", 5, packages=packages)


@needs_sealed_root
def test_python_tool_passes_its_packages():
    assert PythonTool()("import sympy\nprint(sympy.factorint(360))") == "{2: 3, 3: 2, 5: 1}\n"
    assert PythonTool(packages=())("import sympy") == "ModuleNotFoundError: No module named 'sympy'\n"
    assert PythonTool().packages == DEFAULT_PACKAGES


def test_degraded_sandbox_puts_the_package_directories_on_sys_path(monkeypatch):
    # No sealed root, so no allow-list either: the host directories that hold numpy end sys.path.
    monkeypatch.setattr(sandbox, "_namespace_support", lambda: (False, "forced by test", None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        r = run_python("import sys, numpy\nprint(numpy.arange(4).sum(), sys.path[-1])", 5)
    homes = resolve_packages(SANDBOX_PYTHON, DEFAULT_PACKAGES).homes()
    assert r.isolation.startswith("DEGRADED")
    assert r.stdout == f"6 {homes[-1]}\n", r.stderr[-2000:]
