"""The allow-listed packages a sandboxed program may import (`numpy`, `sympy`), and where they come from.

The sealed root hides every site-packages directory, so a program sees the standard library only; traces of
tool-integrated reasoning `import sympy` and `import numpy`. `resolve_packages(python, names)` finds, for each
allowed top-level import name, what its distribution needs at run time:

- the distribution's top-level entries from its RECORD: the package, its other modules (sympy's `isympy.py`),
  its `.dist-info` and its bundled native libraries (`numpy.libs`);
- the same for each distribution it requires (`Requires-Dist` without an `extra` marker), recursively: sympy
  pulls in mpmath. A requirement that is not installed is skipped (its marker excluded this platform, or the
  package manager let it go missing; either way the program sees what the host's interpreter would).

The sandbox's interpreter resolves them itself (`importlib.metadata`, run in that interpreter): first in its own
site directories, then in the caller's when the caller's Python is compatible with it (the same `EXT_SUFFIX`:
implementation, version and platform), because packages for a system interpreter live in a virtual environment
of it (PEP 668): this project's `.venv`, the CUDA image's `/opt/venv`.

`rootfs.rootfs_plan` binds each entry read-only at `PACKAGES_ROOT/<entry>` and `run.py` appends
`PACKAGES_ROOT` to the program's `sys.path` (`-I` ignores PYTHONPATH), so nothing else of site-packages is
there. Without namespaces (the degraded sandbox) there is no sealed root: the program's `sys.path` gets the host
directories holding the entries, and with them everything else installed there.
"""

from __future__ import annotations

import functools
import json
import os
import site
import subprocess
import sysconfig
from dataclasses import dataclass

#: Where the allowed packages appear in the sealed root (one directory on the program's sys.path).
PACKAGES_ROOT = "/opt/sao-packages"

# Runs in the sandbox's interpreter (any Python >= 3.8, standard library only): argv[1] is the request as JSON.
_PROBE = r"""
import importlib.machinery, importlib.metadata as md, json, os, re, site, sys, sysconfig
request = json.loads(sys.argv[1])
dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
if request["ext_suffix"] == sysconfig.get_config_var("EXT_SUFFIX"):
    dirs += [d for d in request["dirs"] if os.path.isdir(d) and d not in dirs]
def norm(name):
    return re.sub(r"[-_.]+", "-", name or "").lower()
def named(name):
    # Looked up by the metadata directory's name (no METADATA is read): the first in search order.
    return next(iter(md.distributions(name=name, path=dirs)), None)
def top_level(dist):
    found = []
    for f in dist.files or ():
        first = f.parts[0] if f.parts else ""
        if first and first not in ("..", "__pycache__") and not first.endswith(".pth") and first not in found:
            found.append(first)
    paths = [os.path.normpath(str(dist.locate_file(f))) for f in found]
    return [p for p in paths if os.path.exists(p)]
def owner(name, entry):
    # The distribution named like the import name, else any in the same directory that lists the entry.
    home = os.path.dirname(entry)
    dist = named(name)
    if dist is not None and entry in top_level(dist):
        return dist
    for dist in md.distributions(path=[home]):
        if entry in top_level(dist):
            return dist
    return None
entries, missing, todo, seen = [], [], [], set()
for name in request["names"]:
    spec = importlib.machinery.PathFinder.find_spec(name, dirs)
    if spec is None:
        missing.append(name)
        continue
    locations = list(spec.submodule_search_locations or [spec.origin])
    entries += [os.path.normpath(p) for p in locations]
    dist = owner(name, os.path.normpath(locations[0]))
    if dist is not None:
        todo.append(dist)
while todo:
    dist = todo.pop()
    if norm(dist.metadata["Name"]) in seen:
        continue
    seen.add(norm(dist.metadata["Name"]))
    entries += top_level(dist)
    for requirement in dist.requires or ():
        required, _, marker = requirement.partition(";")
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", required)
        dep = named(match.group(1)) if match and "extra" not in marker else None
        if dep is not None:
            todo.append(dep)
print(json.dumps({"dirs": dirs, "entries": list(dict.fromkeys(entries)), "missing": missing}))
"""


@dataclass(frozen=True)
class Packages:
    """Where the allowed packages are on the host (plain data, cached per interpreter and allow-list)."""

    entries: tuple[str, ...]
    """Host path of each top-level entry to show (package directories, modules, `.dist-info`, `.libs`)."""
    site_dirs: tuple[str, ...]
    """The site directories searched, in order (a native library found inside one belongs to its entry)."""

    def homes(self) -> tuple[str, ...]:
        """The host directories holding the entries, in search order (the degraded sandbox's sys.path)."""
        held = {os.path.dirname(entry) for entry in self.entries}
        return tuple(d for d in self.site_dirs if d in held) + tuple(sorted(held - set(self.site_dirs)))


NO_PACKAGES = Packages(entries=(), site_dirs=())


@functools.lru_cache(maxsize=16)
def resolve_packages(python: str, names: tuple[str, ...]) -> Packages:
    """The entries `names` (top-level import names) and their requirements need, as the interpreter `python`
    finds them; ValueError naming the first name that is not installed, OSError when `python` cannot be probed."""
    if not names:
        return NO_PACKAGES
    request = {
        "names": list(names),
        "dirs": [os.path.normpath(d) for d in site.getsitepackages()],
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
    }
    argv = [python, "-I", "-c", _PROBE, json.dumps(request)]
    try:
        probe = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"LC_ALL": "C.UTF-8"})
    except (OSError, subprocess.SubprocessError) as exc:
        raise OSError(f"cannot resolve packages {names} in {python}: {exc!r}") from exc
    try:
        found = json.loads(probe.stdout)
    except ValueError as exc:
        raise OSError(f"cannot resolve packages {names} in {python}: {probe.stderr.strip()[-2000:]}") from exc
    if found["missing"]:
        searched = ", ".join(found["dirs"]) or "no site directory"
        raise ValueError(f"packages: {found['missing'][0]!r} is not installed in {python} (searched {searched})")
    return Packages(entries=tuple(found["entries"]), site_dirs=tuple(os.path.normpath(d) for d in found["dirs"]))
