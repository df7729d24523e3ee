"""What a client key may read of ``/metrics``: the gateway's series of the models it may use and its own
per-key series; never other keys' series, other models' series, the engines' own ``sglang:*`` series, or the
gateway-wide series that count every key's work without a key label (:data:`EVERY_KEY`: the batch lines waiting).

The admin keys and ``gateway.metrics_key`` (Prometheus) read everything; an open gateway is open. The scrape is
filtered as text, line by line: samples by their name and their ``key`` and ``model`` labels, and the
``# HELP``/``# TYPE`` lines of the engines' families (their names say what the engines run).
"""

from __future__ import annotations

import re
from collections.abc import Callable

ENGINE_PREFIX = "sglang:"
EVERY_KEY = ("gateway_batch_queued_lines",)  # every key's work in one number: what others have queued is not a key's to read
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scoped_exposition(text: bytes, own_key: str | None, may_see_model: Callable[[str], bool]) -> bytes:
    """``text`` (Prometheus text format) less what a client key must not read: ``own_key`` is its name (None:
    a plain key, which sees no per-key series: plain keys share one label); ``may_see_model(label)`` says
    whether a ``model`` label value is one of its models."""
    kept = []
    for line in text.decode().splitlines(keepends=True):
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) > 2 and (parts[2].startswith(ENGINE_PREFIX) or parts[2] in EVERY_KEY):
                continue
            kept.append(line)
            continue
        name_end = min((at for at in (line.find("{"), line.find(" ")) if at >= 0), default=len(line))
        if line[:name_end].startswith(ENGINE_PREFIX) or line[:name_end] in EVERY_KEY:
            continue
        if line[name_end:name_end + 1] == "{":
            labels = dict(_LABEL.findall(line[name_end:line.rfind("}") + 1]))
            if "key" in labels and (own_key is None or labels["key"] != own_key):
                continue
            if "model" in labels and not may_see_model(labels["model"]):
                continue
        kept.append(line)
    return "".join(kept).encode()
