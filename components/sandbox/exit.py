"""Child side of the sandbox, part 3: how a fork of the zygote ends its program.

Its text follows `child.py` in the zygote's source; standard library only, never imported.

Where this departs from the interpreter: a program forked from the zygote does not end with the interpreter's
teardown of every object, which writes to (so copies) nearly every page inherited from the zygote: about 5 ms
of CPU, more than all the rest of a call. `exit_like_interpreter` keeps what a program can observe of its
end, in the interpreter's order (CPython 3.11 `Py_FinalizeEx`): wait for non-daemon threads, run the atexit
callbacks, flush stdout and stderr, release the program's module globals (names with one leading underscore
first, as `_PyModule_ClearDict` does, so their `__del__` runs), collect cyclic garbage, then flush stdout,
stderr and every other open file object of the program (the interpreter closes them as it frees them); a
failed flush exits with 120, an uncaught SystemExit gives the status `_Py_HandleSystemExit` gives. Not kept:
`__del__` of objects held only by other modules, which CPython does not promise to run at exit either.
`tests/sandbox/test_isolation_between_calls.py` compares programs' ends with a fresh interpreter's.
"""

import os
import sys


def _exit_status(e):
    """The exit status the interpreter gives an uncaught SystemExit (3.11 `_Py_HandleSystemExit`)."""
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if -(2**63) <= code < 2**63 else 255
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def _flush(files):
    """Flush each open file of `files`; False when one failed."""
    ok = True
    for f in files:
        try:
            if f is not None and not f.closed:
                f.flush()
        except Exception:
            ok = False
    return ok


def exit_like_interpreter(exit_status):
    """What the interpreter's exit does that a program can observe, then `_exit`; `exit_status` is the
    program's uncaught SystemExit or an exit status (see the module docstring)."""
    import atexit
    import gc
    import io

    if isinstance(exit_status, SystemExit):
        exit_status = _exit_status(exit_status)
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    atexit._run_exitfuncs()
    ok = _flush((sys.stdout, sys.stderr))
    globals_ = sys.modules["__main__"].__dict__
    for first in (True, False):
        for name in list(globals_):
            if name != "__builtins__" and (not first or (name[:1] == "_" and name[1:2] != "_")):
                globals_[name] = None
    gc.collect()
    files = [sys.stdout, sys.stderr] + [o for o in gc.get_objects() if isinstance(o, io.IOBase)]
    ok = _flush(files) and ok
    os._exit(exit_status if ok else 120)
