"""The README and docs/ say only true things about the repository: every relative link resolves to a file or
directory inside it and every #anchor to a heading of the page it names, every `make` target in the README's code
blocks exists in the Makefile, and every `sao` command line in them parses with the real command line. A moved doc,
a renamed heading, a renamed target or a renamed flag fails here. The README stays a newcomer's page: under
README_MAX_LINES lines, its measurement logs in docs/.

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
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")  # an ATX heading, its closing #s dropped
HTML_ANCHOR = re.compile(r"<a\s[^>]*?\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
README_MAX_LINES = 300


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


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: links and HTML tags reduced to their text, lowercased, every
    character that is not a letter, a digit, a space, '-' or '_' dropped (backticks, colons, parentheses, dots),
    each space turned into '-'."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The #anchors a markdown page has: its headings' slugs outside code blocks (a repeated one gets -1, -2, ...
    as on GitHub) and explicit <a name=...> or id=... anchors."""
    found, seen, fence = set(), {}, None
    for line in text.splitlines():
        match = FENCE.match(line)
        if match and (fence is None or match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence)):
            fence = match.group(1) if fence is None else None
            continue
        if fence is not None:
            continue
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_targets(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code: inline links, whose text may run over several lines of a
    paragraph (reported at the line the link starts on), and [name]: target references."""
    found, paragraph = [], []
    for number, line in [*prose_lines(text), (None, "")]:
        if line.strip() and (not paragraph or number == paragraph[-1][0] + 1):
            paragraph.append((number, line))
            continue
        if paragraph:
            joined = "\n".join(ln for _, ln in paragraph)
            for match in LINK.finditer(joined):
                found.append((paragraph[0][0] + joined.count("\n", 0, match.start()), match.group(1)))
            found += [(n, target) for n, ln in paragraph for target in REFERENCE.findall(ln)]
        paragraph = [(number, line)] if line.strip() else []
    return sorted(found, key=lambda found: found[0])


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of a markdown file that does not resolve, as 'file:line: target (why)': the file or
    directory must exist inside `root`, and a #anchor must be a heading (or an explicit anchor) of the markdown
    page it points at: the page itself for a pure #anchor, a directory's README.md. Links to http(s) and mailto
    are not checked, nor anchors into files that are not markdown."""
    root = root.resolve()
    where = path.relative_to(root) if path.resolve().is_relative_to(root) else path
    problems, pages = [], {}

    def page_anchors(page: Path) -> set[str]:
        if page not in pages:
            pages[page] = anchors(page.read_text())
        return pages[page]

    for number, target in link_targets(path.read_text()):
        if not target or target.lower().startswith(IGNORED):
            continue
        address, _, fragment = target.partition("#")
        relative = unquote(address.split("?", 1)[0])
        if not relative:
            resolved = path.resolve()
        elif relative.startswith("/"):
            resolved = (root / relative.lstrip("/")).resolve()
        else:
            resolved = (path.parent / relative).resolve()
        if not resolved.is_relative_to(root):
            problems.append(f"{where}:{number}: {target} (points outside the repository)")
            continue
        if not resolved.exists():
            problems.append(f"{where}:{number}: {target} (no such file or directory)")
            continue
        if resolved.is_dir():
            resolved = resolved / "README.md"
        if fragment and resolved.suffix == ".md" and resolved.is_file():
            if unquote(fragment) not in page_anchors(resolved):
                problems.append(f"{where}:{number}: {target} (no heading with that anchor)")
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


def test_every_relative_link_and_anchor_resolves():
    problems = [p for path in [README, *DOCS] for p in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_is_a_newcomers_page():
    """Under README_MAX_LINES lines: what it is, the two commands, how to read `make run`, how to go to GPUs.
    Run logs (a dated run's figures, sweeps, timings) belong in docs/, which the README links to."""
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines; move measurement logs to docs/"
    text = "\n".join(lines)
    for needed in ("make run", "make test", "docs/gpu.md", "docs/production.md", "docs/benchmarks.md"):
        assert needed in text, f"the README should mention {needed}"


def test_github_slugs():
    assert slug("`make run` from a fresh clone") == "make-run-from-a-fresh-clone"
    assert slug("(a), (b), (c): stability under forced policy lag") == "a-b-c-stability-under-forced-policy-lag"
    assert slug("7. Work pools and deployments") == "7-work-pools-and-deployments"
    assert slug("`rollout.sandbox_degraded`: refuse or warn") == "rolloutsandbox_degraded-refuse-or-warn"
    assert slug("See [the design](docs/design.md)") == "see-the-design"
    text = '# Top\n## Setup\n```\n# not a heading\n```\n## Setup\n<a name="custom"></a>\n'
    assert anchors(text) == {"top", "setup", "setup-1", "custom"}


def test_the_link_checker_reports_a_planted_broken_link(tmp_path):
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "real.md").write_text("# real\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "DESIGN.md").write_text("exists, but not in the repository\n")
    page = repo / "page.md"
    (repo / "docs" / "README.md").write_text("# The docs\n## Index\n")
    page = repo / "page.md"
    page.write_text(
        "# Top\n"
        "See [the real page](docs/real.md#real) and [docs](docs/), [its index](docs/#index).\n"
        "[web](https://example.com/missing.md#x), [mail](mailto:a@b.c), [here](#top), `[code](nowhere.md)`\n"
        "```\n[in a code block](nowhere.md)\n```\n"
        "And [a missing page](docs/missing.md#section).\n"
        "![a missing picture](images/none.png) and [outside](../elsewhere/DESIGN.md)\n"
        "[a renamed heading](docs/real.md#unreal), [not here](#bottom), [no index entry](docs/#none)\n"
        "\n"
        "A link whose text runs [over\ntwo lines](docs/gone.md) and [a reference][ref].\n"
        "\n"
        "[ref]: docs/also-gone.md\n"
    )
    assert broken_links(page, root=repo) == [
        "page.md:7: docs/missing.md#section (no such file or directory)",
        "page.md:8: images/none.png (no such file or directory)",
        "page.md:8: ../elsewhere/DESIGN.md (points outside the repository)",
        "page.md:9: docs/real.md#unreal (no heading with that anchor)",
        "page.md:9: #bottom (no heading with that anchor)",
        "page.md:9: docs/#none (no heading with that anchor)",
        "page.md:11: docs/gone.md (no such file or directory)",
        "page.md:14: docs/also-gone.md (no such file or directory)",
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
