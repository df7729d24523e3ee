"""Which backend serves which model name (gateway.core.registry): backends, routes, the registry's snapshots (pure).

Managed engines are stand-ins with the attributes the registry reads (no process is started)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.config import GatewaySettings, LimitSettings
from gateway.core.backends import EngineBackend, RouterBackend, UrlBackend
from gateway.core.limits import ConcurrencyLimiter
from gateway.core.registry import ModelRoute, Registry, build_registry, url_backend, with_url_replicas
from launch.config import parse_config


def _engine(**overrides: Any) -> Any:
    fields = {
        "name": "tiny-0", "url": "http://127.0.0.1:30000", "running": True, "returncode": None, "ready": True,
        "phase": "ready", "config": SimpleNamespace(model_path="/nowhere"), "auth_headers": lambda: {"authorization": "Bearer engine-key"},
    }  # fmt: skip
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _router(running: bool = True, returncode: int | None = None) -> Any:
    return SimpleNamespace(running=running, returncode=returncode, url="http://r:1")


def _url(replica: int = 0, name: str = "m", **kwargs: Any) -> UrlBackend:
    return UrlBackend(name, f"http://h:{9000 + replica}", replica=replica, **kwargs)


def test_each_kind_of_backend_says_what_it_is() -> None:
    engine, url, router = EngineBackend("m", _engine()), _url(), RouterBackend("m", _router())
    assert [b.kind for b in (engine, url, router)] == ["engine", "url", "router"]
    assert [b.managed for b in (engine, url, router)] == [True, False, False]
    assert [b.is_router for b in (engine, url, router)] == [False, False, True]
    assert router.url == "http://r:1" and router.describe() == "router at http://r:1"
    assert RouterBackend("m", _router(), api_key="k").upstream_headers() == {"authorization": "Bearer k"}
    assert RouterBackend("m", _router()).upstream_headers() == {}


def test_a_new_backend_is_idle_and_healthy() -> None:
    backend = _url(replica=3)
    assert backend.served_name == "m" and backend.replica == 3
    assert backend.in_flight == 0 and backend.failure is None and backend.retry_after_s is None
    assert backend.last_health is None and backend.context_length is None
    assert len(backend.lost) == 0 and backend.lost.maxlen == 64 and backend.active == set()
    assert backend.created_at > 0
    assert UrlBackend("m", "http://h:1").replica == 0


def test_url_backends_send_their_configured_key() -> None:
    assert _url(api_key="sk-up").upstream_headers() == {"authorization": "Bearer sk-up"}
    assert _url().upstream_headers() == {}
    assert _url(api_key="").upstream_headers() == {}
    managed = EngineBackend("m", _engine())
    assert managed.upstream_headers() == {"authorization": "Bearer engine-key"}  # a managed engine's own random key


def test_url_managed_and_what_is_written_at_once() -> None:
    engine = _engine()
    managed = EngineBackend("m", engine)
    assert managed.managed and managed.url == engine.url and managed.sends_at_once
    engine.url = "http://127.0.0.1:30001"  # learned when the engine starts: read at request time
    assert managed.url == "http://127.0.0.1:30001"
    external = _url()
    assert not external.managed and external.url == "http://h:9000" and not external.sends_at_once
    assert not RouterBackend("m", _router()).sends_at_once  # SGLang's router may wait for ACKs: not an engine of ours


def test_identity_names_url_upstreams_by_url_and_ours_by_a_token() -> None:
    assert _url().identity == "url:http://h:9000"
    assert _url().identity == _url().identity  # an external engine outlives the gateway: same name each time
    a, b = EngineBackend("m", _engine()), EngineBackend("m", _engine())
    assert a.identity.startswith("engine:") and a.identity != b.identity and a.identity == a.identity
    assert len(a.identity.removeprefix("engine:")) == 16
    router = RouterBackend("m", _router())
    assert router.identity.startswith("router:") and router.identity != RouterBackend("m", _router()).identity


def test_vocab_size_of_a_url_model_is_configured(tmp_path: Path) -> None:
    assert _url(vocab_size=32000).vocab_size == 32000
    assert _url().vocab_size is None


def test_vocab_size_of_a_managed_engine_is_read_once_found(tmp_path: Path) -> None:
    engine = _engine(config=SimpleNamespace(model_path=str(tmp_path)))
    backend = EngineBackend("m", engine)
    assert backend.vocab_size is None  # not downloaded yet: unknown, asked again later
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151}))
    assert backend.vocab_size == 151
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 999}))
    assert backend.vocab_size == 151  # read once


def test_why_a_backend_cannot_take_requests() -> None:
    assert _url().unavailable_reason() is None
    failed = _url()
    failed.failure = "draining for a swap"
    assert failed.unavailable_reason() == "draining for a swap"
    assert EngineBackend("m", _engine()).unavailable_reason() is None
    assert EngineBackend("m", _engine(running=False, returncode=-9)).unavailable_reason() == "engine is not running (exit code -9)"
    assert EngineBackend("m", _engine(running=False)).unavailable_reason() == "engine is not running"
    assert EngineBackend("m", _engine(running=False, returncode=0)).unavailable_reason() == "engine is not running (exit code 0)"
    assert EngineBackend("m", _engine(ready=False, phase="loading")).unavailable_reason() == "engine is not ready (loading)"
    stopped = RouterBackend("m", _router(running=False, returncode=3))
    assert stopped.unavailable_reason() == "its router is not running (exit code 3)"
    assert RouterBackend("m", _router()).unavailable_reason() is None
    failed_router = RouterBackend("m", _router(running=False))
    failed_router.failure = "unhealthy"
    assert failed_router.unavailable_reason() == "unhealthy"  # the failure first


def test_describe() -> None:
    assert _url().describe() == "external http://h:9000"
    assert _url(replica=2).describe() == "external http://h:9002 (replica 2)"
    assert EngineBackend("m", _engine(), replica=1).describe() == "engine tiny-0 at http://127.0.0.1:30000 (replica 1)"
    assert EngineBackend("m", _engine()).describe() == "engine tiny-0 at http://127.0.0.1:30000"


def test_a_route_of_one_backend_or_several() -> None:
    single = _url()
    route = ModelRoute("m", single, ("alias",))  # type: ignore[arg-type]
    assert route.replicas == (single,) and route.backend is single
    assert route.names == ("m", "alias")
    assert not route.drained and route.front is None
    assert isinstance(route.limiter, ConcurrencyLimiter) and route.limiter.settings == LimitSettings()
    assert ModelRoute("m", (single,)).limiter is not ModelRoute("m", (single,)).limiter


def test_in_flight_counts_replicas_and_the_router() -> None:
    a, b = _url(0), _url(1)
    a.in_flight, b.in_flight = 2, 3
    route = ModelRoute("m", (a, b))
    assert route.in_flight == 5
    front = RouterBackend("m", _router())
    front.in_flight = 4
    assert ModelRoute("m", (a, b), front=front).in_flight == 9


def test_available_replicas() -> None:
    a, b, c = _url(0), _url(1), _url(2)
    b.failure = "dead"
    assert ModelRoute("m", (a, b, c)).available() == [a, c]


def test_backend_named_finds_replicas_and_the_router() -> None:
    a, b = _url(0), _url(1)
    front = RouterBackend("m", _router())
    route = ModelRoute("m", (a, b), front=front)
    assert route.backend_named(b.identity) is b
    assert route.backend_named(front.identity) is front
    assert route.backend_named("url:http://gone:1") is None
    assert ModelRoute("m", (a,)).backend_named(front.identity) is None


def test_with_backend_replaces_its_replica_or_adds_it() -> None:
    a, b = _url(0), _url(1)
    route = ModelRoute("m", (a, b), ("x",), drained=True)
    new_b = _url(1)
    replaced = route.with_backend(new_b)
    assert replaced.replicas == (a, new_b) and route.replicas == (a, b)  # a new route: the old one is unchanged
    assert replaced.aliases == ("x",) and replaced.drained and replaced.limiter is route.limiter
    c = _url(2)
    assert route.with_backend(c).replicas == (a, b, c)
    assert route.without_replica(0).replicas == (b,)
    assert route.without_replica(5).replicas == (a, b)


def test_the_registry_resolves_names_and_aliases() -> None:
    one = ModelRoute("one", (_url(),), ("default", "uno"))
    two = ModelRoute("two", (_url(),))
    registry = Registry([one, two])
    assert registry.resolve("one") is one and registry.resolve("uno") is one and registry.resolve("two") is two
    assert registry.resolve("nope") is None
    assert registry.route("one") is one and registry.route("uno") is None  # route(): model names only
    assert registry.route("nope") is None
    assert registry.default_route() is one
    assert registry.routes() == (one, two)
    assert registry.names() == ["one", "default", "uno", "two"]
    assert Registry().routes() == () and Registry().names() == [] and Registry().default_route() is None


def test_names_are_unique_across_routes_and_aliases() -> None:
    with pytest.raises(ValueError, match="'x' is used twice"):
        Registry([ModelRoute("a", (_url(),), ("x",)), ModelRoute("x", (_url(),))])
    registry = Registry([ModelRoute("a", (_url(),))])
    with pytest.raises(ValueError, match="used twice"):
        registry.replace([ModelRoute("a", (_url(),)), ModelRoute("a", (_url(),))])
    assert registry.names() == ["a"]  # a refused replacement leaves the registry as it was


def test_the_only_model_is_the_default() -> None:
    only = ModelRoute("solo", (_url(),))
    assert Registry([only]).default_route() is only
    assert Registry([only, ModelRoute("other", (_url(),))]).default_route() is None


def test_put_keeps_the_order_and_adds_at_the_end() -> None:
    a, b, c = (ModelRoute(name, (_url(),)) for name in "abc")
    registry = Registry([a, b, c])
    new_b = ModelRoute("b", (_url(),), ("bee",))
    registry.put(new_b)
    assert registry.routes() == (a, new_b, c) and registry.resolve("bee") is new_b
    d = ModelRoute("d", (_url(),))
    registry.put(d)
    assert registry.routes() == (a, new_b, c, d)
    new_a = ModelRoute("a", (_url(),))
    registry.put(new_a)
    assert registry.routes() == (new_a, new_b, c, d)


def test_set_backend_swaps_one_replica() -> None:
    old0, old1 = _url(0), _url(1)
    registry = Registry([ModelRoute("m", (old0, old1), ("alias",))])
    new1 = _url(1)
    assert registry.set_backend("m", new1) is old1
    assert registry.route("m").replicas == (old0, new1)
    added = _url(2)
    assert registry.set_backend("m", added) is added  # a replica added: itself
    assert registry.route("m").replicas == (old0, new1, added)
    assert registry.set_backend("alias", _url(0)) is None  # model names only
    assert registry.set_backend("nope", _url(0)) is None
    assert registry.route("m").replicas == (old0, new1, added)


def test_backends_lists_each_backend_once() -> None:
    shared, other = _url(0), _url(1)
    registry = Registry([ModelRoute("a", (shared,)), ModelRoute("b", (shared, other))])
    assert registry.backends() == [shared, other]


def test_build_registry_from_a_deployment() -> None:
    deployment = parse_config(
        {
            "models": {
                "tiny": {"engine": {"model_path": "/m", "device": "cpu"}, "aliases": ["default"]},
                "named": {"engine": {"model_path": "/m", "device": "cpu", "served_model_name": "upstream-name"}},
                "ext": {"url": "http://h:1/", "api_key": "k", "vocab_size": 10, "served_model_name": "remote"},
                "plain": {"url": "http://h:2"},
            }
        }
    )
    settings = GatewaySettings(model_limits={"ext": LimitSettings(max_concurrent=3)}, limits=LimitSettings(max_queue=2))
    engines = {"tiny": _engine(), "named": _engine()}
    registry = build_registry(deployment, settings, engines)  # type: ignore[arg-type]
    tiny, named, ext, plain = registry.routes()
    assert tiny.name == "tiny" and tiny.aliases == ("default",) and tiny.backend.engine is engines["tiny"]
    assert tiny.backend.served_name == "tiny"  # an engine serves the model under its name in the file by default
    assert named.backend.served_name == "upstream-name"
    assert ext.backend.url == "http://h:1" and ext.backend.served_name == "remote" and ext.backend.api_key == "k"
    assert ext.backend.vocab_size == 10 and ext.limiter.settings.max_concurrent == 3
    assert plain.backend.served_name == "plain" and plain.limiter.settings == LimitSettings(max_queue=2)
    assert registry.default_route() is tiny
    with pytest.raises(ValueError, match="'tiny' has an engine section but no EngineProcess"):
        build_registry(deployment, settings, {"named": _engine()})  # type: ignore[arg-type]


def test_url_backend_of_an_entry() -> None:
    entry = parse_config({"models": {"m": {"url": "http://h:1", "vocab_size": 5}}}).models["m"]
    backend = url_backend("m", entry)
    assert backend.served_name == "m" and backend.url == "http://h:1" and backend.api_key is None and backend.vocab_size == 5


def test_url_replicas_replace_the_backends_in_order() -> None:
    first = _url(vocab_size=77, name="served")
    route = ModelRoute("m", (first,), ("x",))
    replicated = with_url_replicas(route, [("http://r0:1", "k0"), ("http://r1:1", None)])
    r0, r1 = replicated.replicas
    assert (r0.url, r0.api_key, r0.replica) == ("http://r0:1", "k0", 0)
    assert (r1.url, r1.api_key, r1.replica) == ("http://r1:1", None, 1)
    assert r0.served_name == r1.served_name == "served" and r0.vocab_size == r1.vocab_size == 77
    assert replicated.aliases == ("x",) and replicated.limiter is route.limiter and route.replicas == (first,)
