"""Every `sao` and `make` command in the runbooks (docs/runbooks/*.md) and in the README's Operations section is
real: each `sao` line parses with the real command line (subcommand and every flag), each `make` target exists
in the Makefile. A renamed flag or target fails here instead of at 3 a.m."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from components.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = sorted((ROOT / "docs" / "runbooks").glob("*.md"))
EXPECTED = {
    "README.md",
    "training-collapse.md",
    "stuck-buffer-dead-engine.md",
    "staleness-growth.md",
    "storage-or-mlflow-outage.md",
    "failed-data-gate.md",
    "disk-full.md",
    "crashed-flow-run.md",
}


def _code(text: str) -> list[str]:
    """Command lines: fenced code blocks' lines (continuations joined), and inline `...` spans that carry a flag
    (a bare `sao rollout` in a sentence names a command, it is not a command line)."""
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S)
    lines = [ln.strip() for block in blocks for ln in block.replace("\\\n", " ").splitlines()]
    inline = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
    return [ln for ln in lines + [s.strip() for s in inline if " --" in s] if ln]


def _commands(paths: list[Path], program: str) -> list[tuple[str, list[str]]]:
    found = []
    for path in paths:
        text = path.read_text()
        if path.name == "README.md" and path.parent == ROOT:  # the README's Operations section
            text = text.split("\n## Operations", 1)[-1].split("\n## ", 1)[0] if "\n## Operations" in text else ""
        for line in _code(text):
            if line.startswith(program + " "):
                found.append((f"{path.name}: {line}", shlex.split(line, comments=True)[1:]))
    return found


def _readme_operations() -> Path:
    return ROOT / "README.md"


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.M))


def test_there_is_a_runbook_for_each_alert_and_each_alert_names_one():
    assert EXPECTED <= {p.name for p in RUNBOOKS}
    alerts = (ROOT / "infra" / "prometheus" / "alerts.yml").read_text()
    named = set(re.findall(r"runbook: docs/runbooks/([\w-]+\.md)", alerts))
    assert named and named <= {p.name for p in RUNBOOKS}
    index = (ROOT / "docs" / "runbooks" / "README.md").read_text()
    for alert in re.findall(r"- alert: (\w+)", alerts):
        assert f"`{alert}`" in index, f"{alert} is not in the runbook index"


SAO = _commands(RUNBOOKS + [_readme_operations()], "sao")
MAKE = _commands(RUNBOOKS + [_readme_operations()], "make")


def test_the_runbooks_use_commands():
    assert len(SAO) >= 15 and len(MAKE) >= 1


@pytest.mark.parametrize("where,argv", SAO, ids=[w for w, _ in SAO])
def test_each_sao_command_parses(where, argv):
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: not a valid sao command line (exit {exc.code})")


@pytest.mark.parametrize("where,argv", MAKE, ids=[w for w, _ in MAKE])
def test_each_make_target_exists(where, argv):
    targets = [a for a in argv if not a.startswith("-") and "=" not in a]
    assert targets, where
    missing = set(targets) - _makefile_targets()
    assert not missing, f"{where}: no Makefile target {sorted(missing)}"


def test_a_wrong_flag_or_target_would_be_caught():
    """The checks bite: a misspelt flag fails to parse, an unknown target is not in the Makefile."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--roll-back-to", "10"])
    assert "deploy" in _makefile_targets() and "deploy-all" not in _makefile_targets()
