"""The host side of the sandbox resolved once at import: which interpreter runs sandboxed programs, and which
user they run as. (`components/sandbox/run.py` re-exports both; tests patch them there.)"""

from __future__ import annotations

import os
import pwd
import stat
import sys


def _executable_by_others(path: str) -> bool:
    """True when a user that is neither owner nor in the group can run path."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or not st.st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(real)
    while True:
        try:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        up = os.path.dirname(parent)
        if up == parent:
            return True
        parent = up


def _resolve_interpreter() -> tuple[str, str]:
    candidates = ["/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"]
    for cand in candidates:
        if _executable_by_others(cand):
            return cand, f"system interpreter {cand} (executable by unprivileged users)"
    return sys.executable, (
        f"no python3 executable by unprivileged users among {candidates}; using "
        f"sys.executable ({sys.executable}); after the drop to 'nobody' it may fail "
        "to import modules"
    )


#: Interpreter used for the sandboxed program (module-level, resolved once;
#: may be reassigned before calling run_python).
SANDBOX_PYTHON, SANDBOX_PYTHON_REASON = _resolve_interpreter()


def _nobody_ids() -> tuple[int, int]:
    try:
        pw = pwd.getpwnam("nobody")
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        return 65534, 65534


_NOBODY_UID, _NOBODY_GID = _nobody_ids()
