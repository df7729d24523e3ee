"""Every probe the gateway makes of its backends, over one HTTP client of their own (off the request path).

``/ready`` and the ``gateway_engine_up`` metric ask :meth:`HealthProbes.not_ready`; the watchdog asks
:meth:`HealthProbes.healthy` and :meth:`HealthProbes.progress`; ``/v1/models`` asks :meth:`HealthProbes.context_length`
once per backend.
Requests themselves go through :class:`gateway.data.proxy.Proxy`'s pooled aiohttp session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx
from loguru import logger

from gateway.core.backends import Backend
from launch.sglang_versions import NEWEST, VERSIONS

ProgressMark = tuple[float, ...]
"""What an engine has done so far, as its counters say: a new value means it worked since the last one."""

PROGRESS_COUNTERS = ("sglang:realtime_tokens_total", "sglang:num_requests_total")
"""SGLang's counters of work done (0.5.23): its scheduler adds each forward pass's tokens to the first (decode steps
as they run, prefill batches as they end; written straight to the metrics files, so ``/metrics`` answers without
waiting for the batch); its HTTP process counts each finished request in the second."""


def progress_mark(metrics_text: str) -> ProgressMark | None:
    """The sum of each of :data:`PROGRESS_COUNTERS`' samples in a Prometheus text page (None: it has none of them)."""
    sums = [0.0] * len(PROGRESS_COUNTERS)
    seen = False
    for line in metrics_text.splitlines():
        if not line.startswith("sglang:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for index, counter in enumerate(PROGRESS_COUNTERS):
            if name == counter:
                try:
                    sums[index] += float(line.rsplit(" ", 1)[-1])
                except ValueError:
                    continue
                seen = True
    return tuple(sums) if seen else None


class HealthProbes:
    """Owns the ``httpx.AsyncClient`` of the probes; create it inside the event loop, :meth:`aclose` at the end."""

    def __init__(self, timeout_s: float, connect_timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s), trust_env=False)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def healthy(self, backend: Backend, timeout_s: float | None = None) -> bool:
        """One ``GET /health`` of ``backend``: True only on 200 (SGLang answers 503 while warming up)."""
        try:
            response = await self.client.get(backend.url + "/health", headers=backend.upstream_headers(), timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def progress(self, backend: Backend, timeout_s: float | None = None) -> ProgressMark | None:
        """The engine's work counters now (:func:`progress_mark` of its ``/metrics``), or None when it does not say:
        no answer in time, not 200 (``enable_metrics`` off), or none of the counters."""
        try:
            response = await self.client.get(backend.url + "/metrics", headers=backend.upstream_headers(), timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError:
            return None
        return progress_mark(response.text) if response.status_code == 200 else None

    async def learn_version(self, backend: Backend) -> None:
        """Ask an SGLang server its version and tool-call parser (``/get_server_info``), for the fields its version takes
        and whether it returns tool calls; a server that does not say (not SGLang, or a router) keeps the newest's."""
        backend.server_info_asked = True
        try:
            response = await self.client.get(backend.url + "/get_server_info", headers=backend.upstream_headers())
            info = response.json() if response.status_code == 200 else {}
            version = info.get("version")
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if isinstance(version, str) and version and "tool_call_parser" in info:  # SGLang's server args, said
            parser = info["tool_call_parser"]
            backend.learn_tool_parser(parser if isinstance(parser, str) and parser else None)
            backend.learn_grammar_backend(info)
        if isinstance(version, str) and version:
            backend.sglang_version = version
            if version not in VERSIONS:
                logger.warning(f"{backend.describe()} runs SGLang {version}, not in launch/sglang_versions.py: requests are checked as for {NEWEST}")

    async def not_ready(self, backend: Backend, timeout_s: float | None = None) -> str | None:
        """Why ``backend`` cannot serve now, or None; remembers the answer for the engine-up metric. An external
        engine's SGLang version is learnt at its first ready answer."""
        reason = backend.unavailable_reason()
        if reason is None:
            try:
                response = await self.client.get(
                    backend.url + "/health", headers=backend.upstream_headers(), timeout=timeout_s or self.timeout_s
                )
                reason = None if response.status_code == 200 else f"/health answered {response.status_code}"
            except httpx.HTTPError as error:
                reason = f"/health failed: {type(error).__name__}"
        backend.last_health = reason is None
        if reason is None and backend.sglang_version is None and backend.kind == "url":
            await self.learn_version(backend)
        return reason

    async def engine_requests(self, backend: Backend) -> int | None:
        """Requests running or queued in an SGLang engine, from its ``/metrics`` (None when it cannot tell)."""
        try:
            response = await self.client.get(backend.url + "/metrics")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        total = 0.0
        for line in response.text.splitlines():
            if line.startswith(("sglang:num_running_reqs", "sglang:num_queue_reqs")):
                total += float(line.rsplit(" ", 1)[-1])
        return int(total)

    async def fill_context_lengths(self, backends: Iterable[Backend]) -> None:
        """Ask each backend that does not know its context length yet (SGLang's ``max_model_len``); retried later on failure."""
        missing = [b for b in backends if b.context_length is None and b.unavailable_reason() is None]
        if missing:
            await asyncio.gather(*(self._context_length(backend) for backend in missing))

    async def _context_length(self, backend: Backend) -> None:
        try:
            response = await self.client.get(backend.url + "/v1/models", headers=backend.upstream_headers())
            cards = response.json().get("data", []) if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        for card in cards:
            if isinstance(card, dict) and isinstance(card.get("max_model_len"), int):
                if card.get("id") == backend.served_name or len(cards) == 1:
                    backend.context_length = card["max_model_len"]
                    return
