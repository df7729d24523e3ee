"""Which replica takes a request (gateway.data.balancer): least busy, prefix affinity, the router in front (pure)."""

from __future__ import annotations

from types import SimpleNamespace

import orjson

from gateway.config import BalancingSettings
from gateway.core.backends import Backend, RouterBackend, UrlBackend
from gateway.core.registry import ModelRoute
from gateway.data.balancer import pick, prefix_key

LEAST = BalancingSettings()
AFFINITY = BalancingSettings(policy="prefix_affinity", prefix_chars=16, max_imbalance=2)


def _replicas(count: int) -> list[Backend]:
    return [UrlBackend("m", f"http://h:{8000 + i}", replica=i) for i in range(count)]


def _route(replicas: list[Backend], front: Backend | None = None) -> ModelRoute:
    return ModelRoute("m", tuple(replicas), front=front)


def _router_front(running: bool = True) -> Backend:
    return RouterBackend("m", SimpleNamespace(running=running, returncode=None if running else 1))


def _chat(*contents: str) -> dict:
    return {"messages": [{"role": "user", "content": content} for content in contents]}


def test_no_replica_or_one_replica() -> None:
    (only,) = _replicas(1)
    assert pick(_route([]), LEAST, {}) is None
    assert pick(_route([only]), LEAST, {}) is only
    assert pick(_route([only]), LEAST, {}, exclude=only) is None
    only.failure = "drained"
    assert pick(_route([only]), LEAST, {}) is None


def test_least_in_flight_then_lowest_replica() -> None:
    a, b, c = _replicas(3)
    route = _route([c, b, a])  # listed out of order: the tie goes to the lowest replica number, not the first listed
    assert pick(route, LEAST, {}) is a
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 1
    assert pick(route, LEAST, {}) is b
    assert pick(route, LEAST, {}, exclude=b) is c  # a retry avoids the replica that failed
    c.in_flight = 0
    assert pick(route, LEAST, {}) is c


def test_unavailable_replicas_are_never_picked() -> None:
    a, b, c = _replicas(3)
    b.in_flight, c.in_flight = 5, 6
    a.failure = "being replaced"
    assert pick(_route([a, b, c]), LEAST, {}) is b
    assert pick(_route([a, b, c]), LEAST, {}, exclude=b) is c


def test_the_router_in_front_takes_everything_while_it_runs() -> None:
    a, b = _replicas(2)
    front = _router_front()
    front.in_flight = 100  # busy or not: the router balances, not the gateway
    route = _route([a, b], front)
    assert pick(route, AFFINITY, _chat("hi", "there")) is front
    assert pick(route, LEAST, {}, exclude=front) is a  # a retry after the router failed goes to a replica directly
    stopped = _route([a, b], _router_front(running=False))
    assert pick(stopped, LEAST, {}) is a
    front.failure = "unhealthy"
    assert pick(route, LEAST, {}) is a


def test_the_same_conversation_goes_to_the_same_replica() -> None:
    replicas = _replicas(4)
    route = _route(replicas)
    for turn in range(12):
        first = pick(route, AFFINITY, _chat(f"conversation {turn}", "question one"))
        # a later request of it: the same earlier turns, another last message
        assert pick(route, AFFINITY, _chat(f"conversation {turn}", "question two")) is first
    chosen = {pick(route, AFFINITY, _chat(f"conversation {turn}", "q")).replica for turn in range(64)}
    assert chosen == {0, 1, 2, 3}  # prefixes spread over every replica, not all to one


def test_least_in_flight_ignores_prefixes() -> None:
    replicas = _replicas(4)
    route = _route(replicas)
    assert {pick(route, LEAST, _chat(f"conversation {turn}", "q")).replica for turn in range(16)} == {0}


def test_affinity_yields_to_the_least_busy_beyond_max_imbalance() -> None:
    replicas = _replicas(3)
    route = _route(replicas)
    body = _chat("a long shared system prompt", "q")
    preferred = pick(route, AFFINITY, body)
    others = [backend for backend in replicas if backend is not preferred]
    preferred.in_flight = AFFINITY.max_imbalance  # exactly max_imbalance above the least busy: still preferred
    assert pick(route, AFFINITY, body) is preferred
    preferred.in_flight = AFFINITY.max_imbalance + 1  # one more: the least busy (lowest of the idle ones) takes it
    assert pick(route, AFFINITY, body) is min(others, key=lambda backend: backend.replica)
    others[0].in_flight = others[1].in_flight = 1  # measured against the least busy, not against zero
    assert pick(route, AFFINITY, body) is preferred


def test_a_request_without_a_prefix_goes_to_the_least_busy() -> None:
    a, b, c = _replicas(3)
    a.in_flight = 1
    assert pick(_route([a, b, c]), AFFINITY, {"messages": [{"role": "user", "content": "only one"}]}) is b


def test_a_leaving_replica_moves_only_its_own_prefixes() -> None:
    replicas = _replicas(4)
    route = _route(replicas)
    bodies = [_chat(f"conversation {turn}", "q") for turn in range(48)]
    before = [pick(route, AFFINITY, body) for body in bodies]
    replicas[2].failure = "died"
    after = [pick(route, AFFINITY, body) for body in bodies]
    assert any(backend is replicas[2] for backend in before)
    for old, new in zip(before, after, strict=True):
        assert new is not replicas[2]
        if old is not replicas[2]:
            assert new is old


def test_prefix_of_a_conversation_is_every_message_but_the_last() -> None:
    earlier = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    key = prefix_key({"messages": [*earlier, {"role": "user", "content": "next"}]}, 2048)
    assert key == orjson.dumps([earlier])
    assert prefix_key({"messages": [*earlier, {"role": "user", "content": "other"}]}, 2048) == key
    assert prefix_key({"messages": [{"role": "user", "content": "alone"}]}, 2048) == b""


def test_leading_fields_come_first_when_set() -> None:
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert prefix_key({"system": "be brief", "messages": chat}, 2048) == orjson.dumps(["be brief", chat[:1]])
    both = {"system": "s", "instructions": "i", "input": chat}
    assert prefix_key(both, 2048) == orjson.dumps(["s", "i", chat[:1]])
    assert prefix_key({"system": "", "instructions": None, "messages": chat}, 2048) == orjson.dumps([chat[:1]])
    assert prefix_key({"system": "be brief"}, 2048) == orjson.dumps(["be brief"])  # no conversation: the system prompt


def test_a_prompt_counts_by_its_first_characters_or_tokens() -> None:
    assert prefix_key({"prompt": "abcdefghij"}, 4) == orjson.dumps(["abcd"])
    assert prefix_key({"prompt": "abcdXXXXXX"}, 4) == prefix_key({"prompt": "abcdYYYY"}, 4)
    assert prefix_key({"prompt": [1, 2, 3, 4, 5, 6]}, 4) == orjson.dumps([[1, 2, 3, 4]])
    assert prefix_key({"prompt": ""}, 4) == b""
    assert prefix_key({"prompt": []}, 4) == b""
    assert prefix_key({}, 4) == b""


def test_only_the_first_conversation_field_counts() -> None:
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert prefix_key({"messages": chat, "prompt": "zzzz"}, 2048) == orjson.dumps([chat[:1]])
    assert prefix_key({"input": "text in", "prompt": "other"}, 2048) == orjson.dumps(["text in"])
    assert prefix_key({"input": [7, 8], "prompt": "other"}, 2048) == orjson.dumps([[7, 8]])
    # a field of another type (or an empty list) is skipped for the next one
    assert prefix_key({"messages": [], "prompt": "p"}, 2048) == orjson.dumps(["p"])
    assert prefix_key({"messages": 3, "prompt": "p"}, 2048) == orjson.dumps(["p"])


def test_the_key_is_bounded() -> None:
    long = "x" * 100
    assert len(prefix_key({"system": long, "prompt": long}, 16)) == 16 * 4
    assert prefix_key({"system": long, "prompt": long}, 16) == orjson.dumps([long, long[:16]])[:64]


def test_of_two_replicas_the_less_busy_one() -> None:
    a, b = _replicas(2)
    a.in_flight = 1
    assert pick(_route([a, b]), LEAST, {}) is b
