"""The documentation holds together: the README stays a short door, every relative link and ``#anchor`` in the
README, ``docs/*.md``, ``benchmarks/README.md`` and ``HISTORY.md``, ``tests/README.md`` and ``deploy/**/*.md`` lands on a file that
exists and on a heading of it, and the README links every page of ``docs/``. No engine, no network.

Anchors follow GitHub's heading slugs: the heading's text (link syntax reduced to the link's text) lowercased,
every character dropped but letters, digits, marks, connector punctuation (``_``), hyphens and spaces, spaces
turned into hyphens; a slug seen before on the page gets ``-1``, ``-2``... Lines inside fenced code blocks are
neither headings nor links.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.readme_blocks import DOCS, README, REPO

MAX_README_LINES = 250
LINKED_PAGES = sorted(
    [
        README,
        *DOCS.glob("*.md"),
        REPO / "benchmarks" / "README.md",
        REPO / "benchmarks" / "HISTORY.md",
        REPO / "tests" / "README.md",
        *REPO.glob("deploy/**/*.md"),
    ]
)

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# [text](target) and ![alt](target), text with at most one level of nested brackets, an optional "title"
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_LINK_TEXT = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose(text: str) -> str:
    """``text`` with every line of a fenced code block blanked (line numbers and offsets kept)."""
    lines, fence = text.split("\n"), None
    for i, line in enumerate(lines):
        opened = _FENCE.match(line)
        if fence is None and opened:
            fence, lines[i] = opened[1], ""
        elif fence is not None:
            if (
                opened
                and opened[1][0] == fence[0]
                and len(opened[1]) >= len(fence)
                and not line.strip()[len(opened[1]) :]
            ):
                fence = None
            lines[i] = ""
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = _INLINE_LINK_TEXT.sub(r"\1", heading).strip().lower()
    kept = "".join(
        ch for ch in text if ch in "- " or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc"
    )
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in _prose(text).split("\n"):
        heading = _HEADING.match(line)
        if not heading:
            continue
        base = slug(heading[2])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str


def links(page: Path) -> list[Link]:
    """The links of ``page`` outside code blocks and code spans."""
    text = _prose(page.read_text())
    text = _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), text)  # same offsets, nothing inside
    return [Link(page, text.count("\n", 0, m.start()) + 1, m[1]) for m in _LINK.finditer(text)]


def resolve(link: Link) -> Path | None:
    """The file or folder a relative link points to; None for a link with a scheme (https:, mailto:...)."""
    if _SCHEME.match(link.target):
        return None
    path = link.target.partition("#")[0]
    return (link.page.parent / path).resolve() if path else link.page


def broken(link: Link) -> str | None:
    """Why ``link`` is broken, or None."""
    target = resolve(link)
    if target is None:
        return None
    if not target.exists():
        return f"{_name(target)} does not exist"
    _, hashed, anchor = link.target.partition("#")
    if not hashed:
        return None
    if target.suffix != ".md" or not target.is_file():
        return f"#{anchor} on {target.name}, which is not a Markdown page"
    if anchor not in anchors(target.read_text()):
        return f"no heading of {_name(target)} has the anchor #{anchor}"
    return None


def _name(page: Path) -> str:
    return str(page.relative_to(REPO) if page.is_relative_to(REPO) else page)


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, more than {MAX_README_LINES}: move the detail to a page of docs/ and link it"
    )


@pytest.mark.parametrize("page", LINKED_PAGES, ids=_name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    problems = [
        f"{_name(link.page)}:{link.line}: ({link.target}): {why}" for link in links(page) if (why := broken(link))
    ]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_links_every_docs_page() -> None:
    linked = {resolve(link) for link in links(README)}
    unlinked = [_name(page) for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, f'README.md\'s "Where to go next" does not link {unlinked}'


# ------------------------------------------------------------------ the checker itself
def test_slugs_follow_github() -> None:
    assert slug("Engine section reference (`models.<name>.engine`)") == "engine-section-reference-modelsnameengine"
    assert slug("`gateway:` settings") == "gateway-settings"
    assert slug("Past one machine: SGLang's router, and a Kubernetes recipe") == (
        "past-one-machine-sglangs-router-and-a-kubernetes-recipe"
    )
    assert (
        slug("Swapping models (YAML-driven, no dropped requests)") == "swapping-models-yaml-driven-no-dropped-requests"
    )
    assert (
        slug("MLflow wrapper vs raw `openai` client, see [the figures](#x)")
        == "mlflow-wrapper-vs-raw-openai-client-see-the-figures"
    )
    assert slug("Paced streams: CPU µs per event_count") == "paced-streams-cpu-µs-per-event_count"
    assert anchors("# A\n## A\n```\n# A\n```\n### A!\n") == {"a", "a-1", "a-2"}  # the fenced line is no heading


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Its section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Here\n\n"
        "[ok](other.md#its-section) [ok](#here) [ok](https://example.com/x#y) `[not a link](gone.md)`\n"
        "[gone](gone.md) [no anchor](other.md#nowhere) [no anchor here](#there)\n"
        "```\n[in a fence](gone.md)\n```\n"
    )
    assert [(link.line, link.target, broken(link) is not None) for link in links(page)] == [
        (5, "other.md#its-section", False),
        (5, "#here", False),
        (5, "https://example.com/x#y", False),
        (6, "gone.md", True),
        (6, "other.md#nowhere", True),
        (6, "#there", True),
    ]
