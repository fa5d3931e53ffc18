"""Packages import inward: no cycle between the packages of `components/`, the leaves import no package, and
each room keeps to its role (docs/design.md, layout).

A package is a top-level subpackage (`components/envs`) or module (`components/faults.py`). Every import
counts, function-level ones too: a cycle hidden in a function is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "components"
LEAVES = ("contracts", "algo", "sandbox", "faults")
"""Packages that import no other package of the project (contracts: the shared types; algo: pure math; sandbox:
the security boundary, which trusts nothing else; faults: the fault points every layer may call)."""
FORBIDDEN = {
    "training": ("stages", "envs", "eval", "cli"),
    "rollout": ("training", "stages", "envs", "agent", "cli"),
    "agent": ("training", "stages", "envs", "eval", "cli"),
    "models": ("training", "stages", "rollout", "envs", "cli"),
    "tracking": ("training", "stages", "rollout", "envs", "eval", "cli"),
    "storage": ("training", "stages", "rollout", "envs", "tracking", "cli"),
    "envs": ("training", "stages", "rollout", "agent", "eval", "cli"),
    "eval": ("training", "stages", "cli"),
    "data": ("training", "stages", "envs", "cli"),
    "chat": ("training", "stages", "rollout", "envs", "agent", "eval", "cli", "data", "models", "storage", "tracking"),
}
"""What each room may not import: training knows the learner and the loop, not how episodes are made or how the
lifecycle's stages reuse artifacts; the stages are imported only by the CLI (and by `flows/`, outside)."""


def package_graph(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """{package: {imported package: a file where it is imported}} over `root`'s Python files."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts == ("__init__",):
            continue
        source = parts[0]
        edges = graph.setdefault(source, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
            )
            for name in names:
                head, _, rest = name.partition(".")
                target = rest.split(".")[0]
                if head == "components" and target and target != source:
                    edges.setdefault(target, str(path.relative_to(root.parent)))
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in graph.get(node, {}):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if state.get(target) is None and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if state.get(node) is None and (cycle := visit(node)):
            return cycle
    return None


def test_no_cycle_between_packages():
    graph = package_graph()
    cycle = find_cycle(graph)
    assert cycle is None, (
        "import cycle: " + " -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
    )


def test_leaves_import_no_package():
    graph = package_graph()
    for leaf in LEAVES:
        assert leaf in graph, f"components/{leaf} is gone: update LEAVES"
        assert not graph[leaf], f"components/{leaf} must import no other package, imports {graph[leaf]}"


def test_each_room_keeps_to_its_role():
    graph = package_graph()
    broken = [
        f"{source} imports {target} ({graph[source][target]})"
        for source, banned in FORBIDDEN.items()
        for target in banned
        if target in graph.get(source, {})
    ]
    assert not broken, "\n".join(broken)
    assert {s for s, targets in graph.items() if "stages" in targets} <= {"stages", "cli"}


def test_the_library_imports_neither_flows_nor_tools():
    """Only the CLI runs flows (components/cli/run_flows.py); nothing imports the tools, the benchmarks or tests."""
    for path in sorted(ROOT.rglob("*.py")):
        allowed = ("flows",) if path.name == "run_flows.py" else ()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
            )
            banned = [
                n
                for n in names
                if n.split(".")[0] in ("flows", "tools", "bench", "tests") and n.split(".")[0] not in allowed
            ]
            assert not banned, f"{path} imports {banned}"


def test_flows_call_their_own_stage():
    """`flows/X.py` imports `components.stages.X` and the shared `home` and `recipes`, no other stage
    (`flows/ranks.py` runs the other ranks of a GPU job: `components.stages.ranks`)."""
    flows = ROOT.parent / "flows"
    for path in sorted(flows.glob("*.py")):
        stages = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "components.stages":
                stages |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("components.stages."):
                stages.add(node.module.split(".")[2])
        own = path.stem
        assert stages <= {own, "home", "recipes"}, f"{path.name} imports stages {sorted(stages)}"


def test_the_check_finds_a_planted_cycle(tmp_path):
    root = tmp_path / "components"
    # a -> b -> c -> a through a function-level import in c, plus an unrelated d -> a.
    for name, body in {
        "a/__init__.py": "from components.b import x\n",
        "b.py": "import components.c.deep\n",
        "c/deep.py": "def f():\n    from components.a import y\n",
        "d.py": "from components.a import z\n",
    }.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    graph = package_graph(root)
    assert graph == {
        "a": {"b": "components/a/__init__.py"},
        "b": {"c": "components/b.py"},
        "c": {"a": "components/c/deep.py"},
        "d": {"a": "components/d.py"},
    }
    assert find_cycle(graph) == ["a", "b", "c", "a"]


HEAVY = {
    "mlflow": "about 2 s to import; only the MLflow paths need it",
    "prefect": "about 3 s, and it reads its settings on import (flows/__init__.py sets them first)",
    "great_expectations": "about 4 s; only a validation needs it (components/data/gates.py)",
    "matplotlib": "only the plots need it",
    "deepspeed": "only the DeepSpeed backend needs it, and it probes the accelerator on import",
    "boto3": "only s3:// URIs need it",
    "uvicorn": "only a served process needs it",
}
"""Third-party packages that may be imported inside a function without a comment: importing them where they are
used keeps every other path (the CLI's help, the torch backend, a local store) from paying for them."""
SOURCE_TEXT = {"sandbox/child.py", "sandbox/exit.py", "sandbox/seal.py", "sandbox/zygote_server.py"}
"""The sandbox's child side: programs run inside the sealed interpreter, not modules of the library."""


def test_imports_sit_at_the_top_unless_a_comment_says_why():
    """An import inside a function is either of a `HEAVY` package or has a comment saying why (on its line or on
    the line above its group): a cycle it breaks, a dependency it keeps off the import path."""
    unexplained = []
    for root in (ROOT, ROOT.parent / "flows", ROOT.parent / "tools"):
        for path in sorted(root.rglob("*.py")):
            if str(path.relative_to(ROOT.parent)).removeprefix("components/") in SOURCE_TEXT:
                continue
            lines = path.read_text().splitlines()
            for node in ast.walk(ast.parse("\n".join(lines), str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for sub in ast.walk(node):
                    if not isinstance(sub, (ast.Import, ast.ImportFrom)):
                        continue
                    name = sub.module if isinstance(sub, ast.ImportFrom) else sub.names[0].name
                    if (name or "").split(".")[0] in HEAVY:
                        continue
                    first = sub.lineno - 1
                    while first > 0 and lines[first - 1].strip().startswith(("import ", "from ")):
                        first -= 1  # the top of this group of imports
                    said = "#" in "".join(lines[sub.lineno - 1 : sub.end_lineno]) or lines[
                        first - 1
                    ].strip().startswith("#")
                    if not said:
                        unexplained.append(f"{path.relative_to(ROOT.parent)}:{sub.lineno} {name}")
    assert not unexplained, "imports inside functions with no reason given:\n" + "\n".join(unexplained)


TRAINING_ROOMS = {
    "engines": ("rl", "sft", "value_pretrain", "plan"),
    "rl": ("sft", "value_pretrain", "plan"),
    "sft": ("rl", "value_pretrain", "plan"),
    "value_pretrain": ("rl", "sft", "plan"),
}
"""Inside `components/training/`: the engines know no trainer; the RL loop, SFT and value pretraining know the
engines, not each other (the planner reads the algorithms' table from `rl`)."""


def test_training_rooms_keep_to_their_roles():
    training = ROOT / "training"
    broken = []
    for room, banned in TRAINING_ROOMS.items():
        paths = sorted((training / room).rglob("*.py")) if (training / room).is_dir() else [training / f"{room}.py"]
        assert paths and paths[0].exists(), f"components/training/{room} is gone: update TRAINING_ROOMS"
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("components.training."):
                    target = node.module.split(".")[2]
                    if target in banned:
                        broken.append(f"{path.relative_to(ROOT.parent)} imports components.training.{target}")
    assert not broken, "\n".join(broken)


LONGEST_FUNCTION = 80
"""Lines, decorators and docstring included: a longer function is several steps that want names of their own."""


def test_no_function_is_longer_than_a_screen():
    long = []
    for root in (ROOT, ROOT.parent / "flows"):
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    if node.end_lineno - first + 1 > LONGEST_FUNCTION:
                        long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}")
    assert not long, f"functions over {LONGEST_FUNCTION} lines:\n" + "\n".join(long)
