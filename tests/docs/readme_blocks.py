"""Extract the code blocks of the README and of ``docs/*.md`` that are marked ``<!-- tested: TAG -->`` (the line
before the fence). A tag may live on any of those pages; ``marked_blocks(tag)`` finds it wherever it is."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
_BLOCK = re.compile(r"<!-- tested: (?P<tag>[\w-]+) -->\n```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.DOTALL)


@dataclass(frozen=True)
class Block:
    tag: str
    lang: str
    code: str
    page: Path = README  # the file the block is in


def documentation_pages() -> list[Path]:
    """The pages whose marked blocks are tested: the README, then ``docs/*.md`` in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def marked_blocks(tag: str) -> list[Block]:
    blocks = [
        Block(m["tag"], m["lang"], m["code"], page)
        for page in documentation_pages()
        for m in _BLOCK.finditer(page.read_text())
    ]
    return [b for b in blocks if b.tag == tag]
