"""Every engine route the gateway calls exists in every supported SGLang version.

Each version's routes are pinned from its ``http_server.py`` in launch/sglang_facts/<version>.json (``routes``; the
installed version's file is checked against its sources by tests/launch/test_sglang_versions.py). A version that
lacks one would need an entry in launch/sglang_versions.py refusing the route with the version's name, instead of
the engine's bare 404.
"""

from __future__ import annotations

import pytest

from gateway.control.adapters import LOAD, UNLOAD
from gateway.control.residency import RELEASE, RESUME
from gateway.core.endpoints import INVOCATIONS, PROXIED, RESPONSE_BY_ID, RESPONSE_CANCEL
from launch.sglang_versions import VERSIONS, facts

# The engine paths the gateway and the launcher call (/metrics too, which SGLang mounts outside http_server.py's
# routes when --enable-metrics is on, and so is not in the pinned list).
ENGINE_PATHS = frozenset(
    {route.upstream_path for route in (*PROXIED, INVOCATIONS)}
    | {RESPONSE_BY_ID, RESPONSE_CANCEL, LOAD, UNLOAD, RELEASE, RESUME}
    | {"/health", "/get_server_info", "/v1/models"}
)


def test_the_gateways_engine_paths_include_the_proxied_routes() -> None:
    assert {"/v1/chat/completions", "/v1/messages", "/v1/responses/{response_id}"} <= ENGINE_PATHS


@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_every_engine_path_the_gateway_calls_is_a_route_of_the_version(version: str) -> None:
    routes = set(facts(version)["routes"])
    assert routes, f"{version}: no routes pinned (scripts/sglang_facts.py)"
    missing = sorted(ENGINE_PATHS - routes)
    assert not missing, f"SGLang {version}'s HTTP server has no {missing}"
