"""The README and docs/ say only true things about the repository: every relative link resolves to a file or
directory inside it, every `make` target in the README's code blocks exists in the Makefile, and every `sao` command
line in them parses with the real command line. A moved doc, a renamed target or a renamed flag fails here.

The runbooks' commands are checked the same way by tests/ops/test_runbooks.py, whose Makefile reader this reuses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import unquote

import pytest

from components.cli import build_parser
from tests.ops.test_runbooks import _makefile_targets

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target), an optional "title" after the target; the text may hold one level of [].
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")  # [name]: target
IGNORED = ("http://", "https://", "mailto:")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<"}
TARGET_WORD = re.compile(r"^[A-Za-z0-9][\w.-]*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans removed: where links can be."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match and (fence is None or match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence)):
            fence = match.group(1) if fence is None else None
        elif fence is None:
            out.append((number, INLINE_CODE.sub("", line)))
    return out


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) inside fenced code blocks; a line ending in a backslash is joined with the next one
    under the first line's number."""
    out, fence, pending = [], None, None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match and (fence is None or match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence)):
            fence = match.group(1) if fence is None else None
            continue
        if fence is None:
            continue
        start, joined = pending if pending else (number, "")
        joined += line.strip()
        if joined.endswith("\\"):
            pending = (start, joined[:-1] + " ")
        else:
            pending = None
            if joined:
                out.append((start, joined))
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of a markdown file that does not resolve to a file or directory inside `root`, as
    'file:line: target (why)'. Links to http(s) and mailto and pure #anchors are not checked; a #anchor suffix is
    dropped (the file must exist, its headings are not checked)."""
    root = root.resolve()
    where = path.relative_to(root) if path.resolve().is_relative_to(root) else path
    problems = []
    for number, line in prose_lines(path.read_text()):
        targets = LINK.findall(line) + REFERENCE.findall(line)
        for target in targets:
            if not target or target.startswith("#") or target.lower().startswith(IGNORED):
                continue
            relative = unquote(target.split("#", 1)[0].split("?", 1)[0])
            resolved = (root / relative.lstrip("/") if relative.startswith("/") else path.parent / relative).resolve()
            if not resolved.is_relative_to(root):
                problems.append(f"{where}:{number}: {target} (points outside the repository)")
            elif not resolved.exists():
                problems.append(f"{where}:{number}: {target} (no such file or directory)")
    return problems


def _words(line: str) -> list[str]:
    """The shell words of a code line, comments dropped; output lines that are not shell (an apostrophe in
    prose) fall back to whitespace splitting up to a ' #'."""
    line = re.sub(r"^\$\s+", "", line)
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split(" #", 1)[0].split()


def make_targets(text: str) -> list[tuple[int, str, str]]:
    """(line, target, the line) for every `make TARGET...` in the code blocks: the words after `make` up to a
    shell operator, the next `make` or a word that cannot be a target, without options and VAR=value assignments;
    a word ending in a comma, a semicolon or a closing parenthesis (`(make bench)` in a listing) is the last one."""
    found = []
    for number, line in code_lines(text):
        words = _words(line)
        for i, word in enumerate(words):
            if word.lstrip("(") != "make":
                continue
            for arg in words[i + 1 :]:
                last = arg.endswith((",", ";", ")"))
                arg = arg.rstrip(",;)")
                if arg in SHELL_OPERATORS or arg == "make":
                    break
                if arg.startswith("-") or "=" in arg:
                    continue
                if not TARGET_WORD.match(arg):
                    break
                found.append((number, arg, line))
                if last:
                    break
    return found


def sao_commands(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, the line, argv after `sao`) for every code line that runs `sao` or `.venv/bin/sao` (after any
    VAR=value assignments); lines with <placeholders> or '...' are examples of a shape, not command lines."""
    found = []
    for number, line in code_lines(text):
        if re.search(r"<[^<>\s]+>", line) or "..." in line:
            continue
        words = _words(line)
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
            words = words[1:]
        if words and (words[0] == "sao" or words[0].endswith("/sao")):
            found.append((number, line, words[1:]))
    return found


def test_every_relative_link_resolves():
    problems = [p for path in [README, *DOCS] for p in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_checker_reports_a_planted_broken_link(tmp_path):
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "real.md").write_text("# real\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "DESIGN.md").write_text("exists, but not in the repository\n")
    page = repo / "page.md"
    page.write_text(
        "See [the real page](docs/real.md#real) and [docs](docs/).\n"
        "[web](https://example.com/missing.md), [mail](mailto:a@b.c), [here](#top), `[code](nowhere.md)`\n"
        "```\n[in a code block](nowhere.md)\n```\n"
        "And [a missing page](docs/missing.md#section).\n"
        "![a missing picture](images/none.png) and [outside](../elsewhere/DESIGN.md)\n"
    )
    assert broken_links(page, root=repo) == [
        "page.md:6: docs/missing.md#section (no such file or directory)",
        "page.md:7: images/none.png (no such file or directory)",
        "page.md:7: ../elsewhere/DESIGN.md (points outside the repository)",
    ]


def test_every_make_target_in_the_readme_exists():
    found = make_targets(README.read_text())
    assert len({target for _, target, _ in found}) >= 3, "the README's code blocks should show make targets"
    targets = _makefile_targets()
    missing = [f"README.md:{n}: make {target} ({line})" for n, target, line in found if target not in targets]
    assert not missing, "no such Makefile target:\n" + "\n".join(missing)


SAO = sao_commands(README.read_text())


def test_the_readme_shows_sao_commands():
    assert len(SAO) >= 5


@pytest.mark.parametrize("number,line,argv", SAO, ids=[f"README.md:{n}" for n, _, _ in SAO])
def test_each_sao_command_in_the_readme_parses(number, line, argv):
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"README.md:{number}: not a valid sao command line (exit {exc.code}): {line}")


def test_the_command_checks_bite():
    """A misspelt flag and an unknown target are found; placeholders and other programs are left alone."""
    text = (
        "```bash\n"
        "SAO_HOME=x .venv/bin/sao train --roll-back-to 3\n"
        "sao eval --model <DIR>\n"
        "sao train ...\n"
        "mlflow ui --port 5000   # not sao\n"
        "make deploy-all && make run\n"
        "make soak MINUTES=5 [later]   # make sure\n"
        "tools/   make deploy and make infra-check; bench/ (make bench), the soak (make soak)\n"
        "```\n"
        "make prose-outside-a-block\n"
    )
    [(number, _, argv)] = sao_commands(text)
    assert number == 2 and argv == ["train", "--roll-back-to", "3"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert [(n, t) for n, t, _ in make_targets(text)] == [
        (6, "deploy-all"),
        (6, "run"),
        (7, "soak"),
        (8, "deploy"),
        (8, "and"),
        (8, "infra-check"),
        (8, "bench"),
        (8, "soak"),
    ]
    assert "deploy-all" not in _makefile_targets()
