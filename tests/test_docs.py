"""The documents fit and hold together: the README is a front page (≤ 150 lines) and ARCHITECTURE an overview
(≤ 300 lines); every relative link in README.md, BENCHMARKS.md and docs/*.md reaches a file in the repository
(and a heading, when it names one); nothing points at ``../shared/``; no user-facing page tells the development
history ("session N" lives in BENCHMARKS.md's history only) or calls ``hybrid`` the default policy (it is ``auto``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
LINKED = [REPO / "README.md", REPO / "BENCHMARKS.md", *DOCS]
#: pages a user reads for how things are now (BENCHMARKS.md is the measurement history; DESIGN.md the founding design)
USER_PAGES = [REPO / "README.md", *(p for p in DOCS if p.name != "DESIGN.md")]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links are only looked for in prose)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (duplicates numbered as GitHub numbers them)."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def test_the_readme_is_a_front_page():
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= 150, f"README.md has {n} lines (at most 150): move detail to a docs page"


def test_architecture_is_an_overview():
    n = len((REPO / "docs" / "ARCHITECTURE.md").read_text().splitlines())
    assert n <= 300, f"docs/ARCHITECTURE.md has {n} lines (at most 300): move detail to docs/kernels.md or a docs page"


def test_the_docs_pages_exist_and_the_readme_links_them():
    readme_links = set(links(REPO / "README.md"))
    for page in ("docs/install.md", "docs/decoding.md", "docs/training.md", "docs/serving.md", "docs/gguf.md",
                 "docs/kernels.md", "docs/ARCHITECTURE.md", "docs/DESIGN.md", "BENCHMARKS.md"):
        assert (REPO / page).is_file(), page
        assert any(link.split("#")[0] == page for link in readme_links), f"README.md does not link {page}"


def test_slugs():
    assert slug("One pass and `auto`") == "one-pass-and-auto"
    assert slug("The Vulkan runtime") == "the-vulkan-runtime"
    assert slug("Figures (AVX2, 2026-12-01)") == "figures-avx2-2026-12-01"
    sample = "see [a](x.md#b), ![img](i.png) and `[not](a link)`\n```\n[nor](this)\n```\n"
    assert LINK.findall(prose(sample)) == ["x.md#b", "i.png"]


@pytest.mark.parametrize("page", LINKED, ids=_rel)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if "../shared/" in target or not dest.is_relative_to(REPO):
            broken.append(f"{target} (outside the repository)")
        elif not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {_rel(dest)})")
    assert not broken, f"{_rel(page)}: broken links: {broken}"


def test_no_page_points_at_shared():
    hits = [f"{_rel(p)}:{n}" for p in LINKED for n, line in enumerate(p.read_text().splitlines(), 1)
            if "../shared/" in line]
    assert not hits, hits


@pytest.mark.parametrize("page", USER_PAGES, ids=_rel)
def test_user_pages_tell_no_development_history(page):
    pat = re.compile(r"\bsessions? ?-?\d", re.IGNORECASE)
    hits = [f"{n}: {line.strip()[:80]}" for n, line in enumerate(page.read_text().splitlines(), 1) if pat.search(line)]
    assert not hits, f"{_rel(page)}: development history belongs in BENCHMARKS.md's history: {hits}"


@pytest.mark.parametrize("page", [REPO / "README.md", *DOCS], ids=_rel)
def test_hybrid_is_not_called_the_default(page):
    pat = re.compile(r"\bdefault\b[^.|\n]{0,12}[`\"(]*hybrid\b|\bhybrid\b[`\"]*\)?,? (?:is|as) the default", re.I)
    hits = [f"{n}: {line.strip()[:100]}" for n, line in enumerate(page.read_text().splitlines(), 1) if pat.search(line)]
    assert not hits, f"{_rel(page)}: the default policy is auto: {hits}"
