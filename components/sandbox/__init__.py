"""The sealed interpreter for untrusted, model-generated Python: the project's security boundary.

`run_python(code)` (run.py) is the one entry point; docs/sandbox.md has each layer, its test and its cost.

    run.py            run_python, SandboxResult: picks the zygote or the per-call path, degrades loudly;
                      degraded_reason: why this process's calls would run degraded (None: sealed)
    zygote.py         host side of the pre-started, pre-sealed interpreter that forks one sandbox per call
    zygote_server.py  its loop inside the sandbox (source text, never imported)
    percall.py        a fresh interpreter per call under unshare (fallback, and SAO_SANDBOX_ZYGOTE=0)
    seal.py           the sealed read-only root, seccomp filter and audit hook (source text for the child)
    child.py          the supervisor inside the sandbox: drop privileges, limits, run, reap (source text)
    exit.py           how a fork of the zygote ends (source text)
    rootfs.py         what the sealed root holds: the interpreter, its standard library and libraries
    packages.py       the allow-listed packages a program may import (numpy, sympy) and where they are found
    proc.py           outcomes, output files and errors shared by both launchers
    host.py           the interpreter and the unprivileged user the sandbox runs as
"""

from components.sandbox.run import SandboxError, SandboxResult, degraded_reason, run_python

__all__ = ["SandboxError", "SandboxResult", "degraded_reason", "run_python"]
