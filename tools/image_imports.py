"""Every image holds what its code imports: for each infra/docker/*.Dockerfile, the project's Python files its COPY
lines take from the repository, and every first-party module those files import (at the top or inside a function:
vLLM's worker extension imports inside its methods), followed through the modules they import in turn. A module of
this project that is imported and not copied is a problem naming the Dockerfile, the importing file and the module.

Third-party modules are the base image's business and are not checked here; only the packages this repository holds
(`FIRST_PARTY`) are followed. A package's `__init__.py` counts as imported with any module below it.
"""

from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path

FIRST_PARTY = ("components", "flows", "tools", "bench")


def instruction_words(args: str) -> list[str]:
    """A Dockerfile instruction's arguments as words, in its exec (JSON) or shell form."""
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def copy_sources(args: str) -> list[str]:
    """The build-context sources of a COPY/ADD line's arguments (none for a copy from another stage, `--from`)."""
    words = instruction_words(args)
    if any(w.startswith("--from") for w in words):
        return []
    return [w for w in words if not w.startswith("--")][:-1]


def copied_files(root: Path, instructions) -> set[str]:
    """Repository-relative paths of the files the Dockerfile's COPY/ADD lines take from the build context (`root`);
    a copied directory brings every file below it."""
    files: set[str] = set()
    for _, word, args in instructions:
        for source in copy_sources(args) if word in ("COPY", "ADD") else ():
            for match in root.glob(source.lstrip("/")):
                paths = [match] if match.is_file() else [p for p in match.rglob("*") if p.is_file()]
                files.update(p.relative_to(root).as_posix() for p in paths if "__pycache__" not in p.parts)
    return files


def imported_modules(path: Path) -> set[str]:
    """The absolute module names `path` imports anywhere in its body (`from x import y` also names `x.y`, which is
    a module when `y` is one)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def module_files(root: Path, module: str) -> list[str] | None:
    """The repository files importing `module` loads (its package's `__init__.py` files, then its own file), or None
    when `module` is not a module of this repository (a third-party one, or a name imported from a module)."""
    parts = module.split(".")
    if parts[0] not in FIRST_PARTY:
        return None
    own = [f"{'/'.join(parts)}.py", f"{'/'.join(parts)}/__init__.py"]
    found = next((f for f in own if (root / f).is_file()), None)
    if found is None:
        return None
    return [f"{'/'.join(parts[:i])}/__init__.py" for i in range(1, len(parts))] + [found]


def missing_imports(root: Path, copied: set[str]) -> list[tuple[str, str]]:
    """(importing file, missing repository file) for every first-party module reached from the copied Python files
    whose files the image lacks."""
    missing, seen = [], set()
    todo = sorted(f for f in copied if f.endswith(".py"))
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for module in sorted(imported_modules(root / current)):
            for needed in module_files(root, module) or ():
                if needed not in copied:
                    missing.append((current, needed))
                elif needed not in seen:
                    todo.append(needed)
    return sorted(set(missing))


def check_image_imports(root: Path, dockerfiles: list[Path], instructions_of) -> list[str]:
    """The problems of every Dockerfile whose copied code imports a repository module it does not copy."""
    problems = []
    for dockerfile in dockerfiles:
        rel = dockerfile.relative_to(root).as_posix()
        copied = copied_files(root, instructions_of(dockerfile))
        for importer, needed in missing_imports(root, copied):
            problems.append(f"{rel}: {importer} imports {needed}, which the image does not copy (add a COPY line)")
    return problems
