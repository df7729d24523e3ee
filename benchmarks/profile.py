"""Read py-spy's ``raw`` (collapsed stacks) output: where the gateway process spends its CPU."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")

# Leaf-frame file path fragments -> a component name (first match wins)
COMPONENTS: list[tuple[str, str]] = [
    ("/gateway/", "gateway (our code)"),
    ("/aiohttp/", "aiohttp (upstream client)"),
    ("/multidict/", "aiohttp (upstream client)"),
    ("/yarl/", "aiohttp (upstream client)"),
    ("/httpcore/", "httpcore (upstream client)"),
    ("/httpx/", "httpx (upstream client)"),
    ("/anyio/", "anyio"),
    ("/h11/", "h11 (HTTP parser)"),
    ("/httptools/", "httptools (HTTP parser)"),
    ("/uvicorn/", "uvicorn"),
    ("/starlette/", "starlette"),
    ("/fastapi/", "fastapi"),
    ("/pydantic", "pydantic"),
    ("/prometheus_client/", "prometheus_client"),
    ("/loguru/", "loguru"),
    ("/asyncio/", "asyncio"),
    ("uvloop", "uvloop"),
    ("/ssl.py", "ssl"),
]


def _parse(frame: str) -> tuple[str, str]:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip(), ""
    return match.group("func"), match.group("file")


# Entry frames every sample passes through (the CLI, uvicorn's loop runner): left out of the inclusive list
_ENTRY = (
    "<module>",
    "typer/",
    "click/",
    "gateway/cli.py",
    "gateway/server.py",
    "uvicorn/server.py",
    "uvicorn/_compat.py",
    "asyncio/runners.py",
    "asyncio/base_events.py",
    "asyncio/events.py",
)


def component(file: str) -> str:
    file = "/" + file
    for fragment, name in COMPONENTS:
        if fragment in file:
            return name
    return "other (stdlib/native)" if file else "native"


def analyse(raw: Path, top: int = 15) -> dict[str, Any]:
    """Self and inclusive sample shares per function, and self share per component."""
    self_fn: Counter[str] = Counter()
    incl_fn: Counter[str] = Counter()
    comp: Counter[str] = Counter()
    comp_incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_parse(f) for f in stack.split(";") if f]
        frames = [f for f in frames if not f[0].startswith("process ") and not f[0].startswith("thread ")]
        if not frames:
            continue
        func, file = frames[-1]
        self_fn[f"{func} ({_short(file)})"] += count
        comp[component(file)] += count
        for name in {f"{fn} ({_short(fl)})" for fn, fl in frames if not any(e in fn or e in fl for e in _ENTRY)}:
            incl_fn[name] += count
        for name in {component(fl) for _, fl in frames if fl}:
            comp_incl[name] += count

    def share(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, 100.0 * n / total) for name, n in counter.most_common(top)] if total else []

    return {
        "samples": total,
        "self_by_component_pct": share(comp),
        "inclusive_by_component_pct": share(comp_incl),
        "self_by_function_pct": share(self_fn),
        "inclusive_by_function_pct": share(incl_fn),
    }


def _short(file: str) -> str:
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in file:
            return file.split(marker, 1)[1]
    return file
