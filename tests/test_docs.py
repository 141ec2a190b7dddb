"""The README is a front door, and the docs' links lead somewhere.

    python -m pytest -q tests/test_docs.py

- README.md has at most 300 lines (what fastpar is, the two commands, a tour, links; the
  measurements live in docs/benchmarks.md).
- Every relative link, ``[text](path)`` or ``[text](path#anchor)``, in README.md and docs/*.md
  names a file or directory that exists, and an ``#anchor`` into a markdown file (or a bare
  ``#anchor`` into the file itself) names one of its headings by GitHub's rule: the heading's
  text lowercased, every character but letters, digits, ``_``, ``-`` and spaces dropped, spaces
  turned into ``-``, and ``-1``, ``-2``, ... added to repeats. http(s) and mailto links are not
  followed. Links inside code (fenced blocks, inline spans) are not links and are skipped.

Single process, no MPI, no torch: a fraction of a second.
"""

import os
import re
import sys

import pytest

pytestmark = pytest.mark.quick

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 300

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or [text](target "title"); the text may hold brackets one level deep
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before repeats are numbered)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    """Every heading anchor of a markdown file, repeats numbered as GitHub numbers them."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: str):
    """(line number, target) of every link in a markdown file's prose; a link's text may run
    over several lines."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    prose = dict(_prose_lines(text))
    lines = [prose.get(n, "") for n in range(1, len(text.split("\n")) + 1)]
    # inline code blanked with spaces of its length, so that offsets still give line numbers
    body = _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), "\n".join(lines))
    for m in _LINK.finditer(body):
        yield body.count("\n", 0, m.start()) + 1, m.group(1)


def broken_links(path: str) -> list[str]:
    """Every relative link of the markdown file at path that leads nowhere, as 'file:line: why'."""
    problems = []
    here = os.path.dirname(path)
    cache: dict[str, set[str]] = {}
    for number, target in links(path):
        if re.match(r"^(https?:|mailto:)", target, re.IGNORECASE):
            continue
        where = f"{os.path.relpath(path, ROOT)}:{number}: ({target})"
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(here, file_part)) if file_part else path
        if not os.path.exists(dest):
            problems.append(f"{where} no file {os.path.relpath(dest, ROOT)}")
            continue
        if not anchor:
            continue
        if not dest.endswith(".md") or os.path.isdir(dest):
            problems.append(f"{where} an anchor into {os.path.relpath(dest, ROOT)}, "
                            "which is not a markdown file")
            continue
        if dest not in cache:
            cache[dest] = anchors(dest)
        if anchor not in cache[dest]:
            near = sorted(a for a in cache[dest] if anchor[:8] in a)[:5]
            problems.append(f"{where} no heading #{anchor} in {os.path.relpath(dest, ROOT)}"
                            + (f" (near: {', '.join(near)})" if near else ""))
    return problems


def _documents() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(docs, name) for name in os.listdir(docs) if name.endswith(".md"))


def test_readme_is_at_most_300_lines():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        n = len(f.read().splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines, more than {README_MAX_LINES}: move the detail into docs/")


@pytest.mark.parametrize("path", _documents(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_links_into_docs():
    targets = {t.partition("#")[0] for _, t in links(os.path.join(ROOT, "README.md"))}
    for name in ("docs/benchmarks.md", "docs/gpu.md", "docs/design.md"):
        assert name in targets, f"README.md does not link {name}"


def test_the_checker_finds_what_is_broken(tmp_path, monkeypatch):
    """The checker itself: a missing file, a missing anchor, an anchor into a non-markdown
    file are reported; good links, repeated headings, code and web links are not."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text(
        "# B: the `other` file\n\n## Step 1\n\n## Step 1\n\n```\n# not a heading\n```\n")
    (tmp_path / "c.txt").write_text("plain\n")
    (tmp_path / "a.md").write_text(
        "# A\n\n## Its part\n\n"
        "[ok](sub/b.md) [ok](sub/b.md#b-the-other-file) [ok](sub/b.md#step-1-1) [ok](#its-part)\n"
        "[ok](c.txt) [web](https://example.com/x.md#nope) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n"
        "[gone](missing.md) [bad](sub/b.md#not-a-heading) [txt](c.txt#x) [self](#nowhere)\n"
        "[a text over\ntwo lines](also-missing.md)\n")
    problems = broken_links(str(tmp_path / "a.md"))
    assert len(problems) == 5, problems
    assert "no file missing.md" in problems[0]
    assert "no heading #not-a-heading in sub/b.md" in problems[1]
    assert "not a markdown file" in problems[2]
    assert "no heading #nowhere in a.md" in problems[3]
    assert problems[4].startswith("a.md:11:") and "no file also-missing.md" in problems[4]


def test_slug_follows_github():
    assert slug("`python -m fastpar info`") == "python--m-fastpar-info"
    assert slug("The planner's own best") == "the-planners-own-best"
    assert slug("Context parallelism: attention") == "context-parallelism-attention"
    assert slug("`scripts/main.sh`") == "scriptsmainsh"
    assert slug("ZeRO-3's gathers") == "zero-3s-gathers"
