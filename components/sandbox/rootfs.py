"""Parent side of the sealed root: which host paths the sandbox's minimal read-only root holds.

`rootfs_plan(python)` asks the interpreter for its `sys.path` (with `-I -S`, the flags the sandbox uses, so
no site-packages or dist-packages are on it) and asks `ldd` which shared libraries the interpreter and its
extension modules (lib-dynload) load. The plan is:

- `binds`: real (symlink-free) host paths to bind-mount read-only at the same place: the interpreter binary,
  the standard library directories, each shared library file and the dynamic loader, plus `libgcc_s` (glibc
  loads it with dlopen for thread cancellation, so ldd does not list it);
- `links`: the symlinks on the way to them (`/lib -> usr/lib`, `/usr/bin/python3 -> python3.11`,
  `libz.so.1 -> libz.so.1.2.13`), recreated as symlinks so every path the interpreter uses still resolves;
- `masks`: site-packages / dist-packages directories inside a bound standard library, hidden under an empty
  read-only tmpfs;
- `packages`: `(host path, path in the root)` of each entry of the allowed packages (`packages.py`), bound
  read-only under `PACKAGES_ROOT`. `ldd` also runs over their extension modules: a library they load from a
  searched site directory (`numpy.libs`) brings its whole entry there, one from elsewhere (`libstdc++`) a bind
  at its own path, like the interpreter's.

When `ldd` is missing or fails, the directories holding the C library and the loader are bound whole
(`libs=dirs` in the report instead of `libs=ldd`). The plan is computed once per interpreter and cached; it
is plain data (JSON on the bootstrap's command line), so a pre-started forking interpreter can reuse it; a
different allow-list is a different plan (and so a different zygote).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess

from components.sandbox.packages import PACKAGES_ROOT, resolve_packages

_PROBE = "import json, sys; print(json.dumps({'exe': sys.executable, 'path': sys.path}))"
_LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")
_PACKAGE_DIRS = ("site-packages", "dist-packages")


class _Plan:
    def __init__(self) -> None:
        self.binds: set[str] = set()
        self.links: dict[str, str] = {}
        self.packages: dict[str, str] = {}  # name in PACKAGES_ROOT -> host path (the first of a name wins)

    def add_package(self, path: str) -> None:
        self.packages.setdefault(os.path.basename(path), path)

    def add(self, path: str, depth: int = 0) -> None:
        """Record every symlink on the way to `path` and bind the real file or directory it names."""
        if depth > 40:
            raise OSError(f"too many symlinks resolving {path}")
        parts = [p for p in os.path.normpath(path).split("/") if p]
        current = "/"
        for i, part in enumerate(parts):
            step = os.path.join(current, part)
            if os.path.islink(step):
                target = os.readlink(step)
                self.links[step] = target
                rest = "/".join(parts[i + 1 :])
                self.add(os.path.normpath(os.path.join(current, target, rest)), depth + 1)
                return
            current = step
        if os.path.exists(current):
            self.binds.add(current)

    def as_dict(self) -> dict:
        binds = sorted(self.binds)
        # A bind inside another bound directory is already there; so is a symlink inside one.
        kept = [b for b in binds if not any(b != d and b.startswith(d + "/") for d in binds)]
        links = sorted((p, t) for p, t in self.links.items() if not any(p.startswith(d + "/") for d in kept))
        masks = sorted(
            os.path.join(d, name)
            for d in kept
            if os.path.isdir(d)
            for name in _PACKAGE_DIRS
            if os.path.isdir(os.path.join(d, name))
        )
        packages = [[path, f"{PACKAGES_ROOT}/{name}"] for name, path in sorted(self.packages.items())]
        return {"binds": kept, "links": links, "masks": masks, "packages": packages}


def _shared_libraries(files: list[str]) -> list[str] | None:
    ldd = shutil.which("ldd", path="/usr/bin:/bin")
    if ldd is None or not files:
        return None
    try:
        proc = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=30, env={"LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return None
    libs = sorted({m.group(1) for m in _LDD_LINE.finditer(proc.stdout)})
    return libs or None


def _extension_modules(entries: tuple[str, ...]) -> list[str]:
    """The shared objects (`*.so`, `*.so.N`) in the package entries `entries`."""
    found = []
    for entry in entries:
        if os.path.isfile(entry):
            found += [entry] if _is_shared_object(entry) else []
            continue
        for root, _, files in os.walk(entry):
            found += [os.path.join(root, f) for f in sorted(files) if _is_shared_object(f)]
    return found


def _is_shared_object(name: str) -> bool:
    return name.endswith(".so") or ".so." in os.path.basename(name)


def _site_entry(lib: str, site_dirs: tuple[str, ...]) -> str | None:
    """The top-level entry of a searched site directory that holds `lib` (`.../numpy.libs`), or None."""
    for site_dir in site_dirs:
        if lib.startswith(site_dir + "/"):
            return os.path.join(site_dir, lib[len(site_dir) + 1 :].split("/")[0])
    return None


@functools.lru_cache(maxsize=16)
def rootfs_plan(python: str, packages: tuple[str, ...] = ()) -> tuple[str, str]:
    """`(plan as JSON, report word)` for the interpreter `python` with the allowed `packages` (top-level import
    names, see `packages.resolve_packages`); OSError when it cannot be probed, ValueError naming a package that is
    not installed."""
    allowed = resolve_packages(python, packages)
    try:
        probe = subprocess.run(
            [python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=30, env={"LC_ALL": "C.UTF-8"}
        )
        info = json.loads(probe.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise OSError(f"cannot probe sandbox interpreter {python}: {exc!r}") from exc
    plan = _Plan()
    for entry in allowed.entries:
        plan.add_package(entry)
    plan.add(python)
    plan.add(info["exe"])
    stdlib = [p for p in info["path"] if p and os.path.isdir(p) and os.path.basename(p) not in _PACKAGE_DIRS]
    for directory in stdlib:
        plan.add(directory)
    extensions = [os.path.join(d, f) for d in stdlib for f in sorted(os.listdir(d)) if f.endswith(".so")]
    libs = _shared_libraries([os.path.realpath(python), *extensions, *_extension_modules(allowed.entries)])
    if libs is None:
        multiarch = f"{os.uname().machine}-linux-gnu"
        for directory in ("/lib64", "/usr/lib64", f"/lib/{multiarch}", f"/usr/lib/{multiarch}"):
            if os.path.isdir(directory):
                plan.add(directory)
        report = "libs=dirs"
    else:
        for lib in map(os.path.normpath, libs):
            entry = _site_entry(lib, allowed.site_dirs)
            if entry is None:
                plan.add(lib)
            else:
                plan.add_package(entry)
        for lib in libs:
            gcc_s = os.path.join(os.path.dirname(os.path.realpath(lib)), "libgcc_s.so.1")
            if os.path.basename(lib).startswith("libc.so") and os.path.exists(gcc_s):
                plan.add(gcc_s)
        report = "libs=ldd"
    return json.dumps(plan.as_dict()), report
