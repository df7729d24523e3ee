"""Extract the README's code blocks that are marked ``<!-- tested: TAG -->`` (the line before the fence)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"<!-- tested: (?P<tag>[\w-]+) -->\n```(?P<lang>\w+)\n(?P<code>.*?)\n```", re.DOTALL)


@dataclass(frozen=True)
class Block:
    tag: str
    lang: str
    code: str


def marked_blocks(tag: str) -> list[Block]:
    blocks = [Block(m["tag"], m["lang"], m["code"]) for m in _BLOCK.finditer(README.read_text())]
    return [b for b in blocks if b.tag == tag]
