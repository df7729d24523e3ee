"""What a test reads of a running gateway besides its answers: the admin API and the Prometheus series.

The rigs of the engine-lifecycle tests (residency, replicas, swaps) all ask the same questions of the gateway they
run (its models, a counter, a few counters at once): :class:`AdminClient` asks them, for any object with a
``server`` that has a ``url`` (an in-process :class:`~tests.gateway_server.GatewayServer` or a server process).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Protocol

import httpx

from tests.gateway_server import KEY, auth


def prometheus_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one sample in Prometheus text format (labels must all match), or None."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        match = re.match(r"^([^{\s]+)(\{([^}]*)\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(3) or ""))
        if all(found.get(k) == v for k, v in (labels or {}).items()):
            return float(match.group(4))
    return None


class _Served(Protocol):
    url: str


class AdminClient:
    """The admin API and ``/metrics`` of ``self.server``: a base of the rigs, which set ``admin_key`` (and may set
    ``metrics_key``, ``admin_timeout_s``). ``/metrics`` is read with a client key, as a client of the rig sees it."""

    server: _Served
    admin_key: ClassVar[str]
    metrics_key: ClassVar[str] = KEY
    admin_timeout_s: ClassVar[float] = 60

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, self.server.url + path, headers=auth(self.admin_key), timeout=self.admin_timeout_s, **kwargs)

    def listed_models(self) -> dict[str, dict[str, Any]]:
        """``GET /admin/models``, by name."""
        return {model["name"]: model for model in self.admin("GET", "/admin/models").json()["models"]}

    def metrics_text(self) -> str:
        return httpx.get(self.server.url + "/metrics", headers=auth(self.metrics_key), timeout=30).text

    def metric(self, name: str, **labels: str) -> float:
        """One series' value (0 when the gateway has none yet)."""
        return prometheus_value(self.metrics_text(), name, labels) or 0.0

    def metric_values(self, series: dict[str, tuple[str, dict[str, str]]]) -> dict[str, float]:
        """Several series read at once (one scrape), by the caller's names for them."""
        text = self.metrics_text()
        return {key: prometheus_value(text, name, labels) or 0.0 for key, (name, labels) in series.items()}
