"""A 2-worker gateway with two named keys in front of a FAKE engine: one key cannot reach what it should not.

The quarantine holds a failure against the key that caused it, not against every key in flight: one key
freezing the engine twice, with another key's ordinary requests in flight, gets its own shapes refused and
leaves the other key served (the control process gathers the suspects from the workers). And a worker's
admin forwarder refuses paths with dot segments, however encoded, which would reach the control's other routes."""

from __future__ import annotations

import http.client
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_engine import FREEZE, fake_engine_python
from tests.gateway.test_workers import ADMIN, admin, engine_pid, serve, wait_engine_replaced
from tests.gateway_server import auth
from tests.leaks import leaves_nothing
from tests.servers import ServerProcess
from tests.waiting import wait_until

KEY_A, KEY_B = "key-of-tenant-a", "key-of-tenant-b"
ORDINARY = {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 400}
FROZEN = {"model": "tiny", "messages": [{"role": "user", "content": FREEZE}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """A 2-worker gateway with named keys a and b (and an admin key) in front of a FAKE engine (50 ms a piece)."""
    tmp_path = tmp_path_factory.mktemp("keyed")
    engine = {"model_path": str(tiny_model_dir), "device": "cpu", "python": str(fake_engine_python(tmp_path)), "env": {"FAKE_ENGINE_TOKEN_S": "0.05"}}
    config = {
        "gateway": {"workers": 2, "keys": [{"name": "a", "key": KEY_A}, {"name": "b", "key": KEY_B}], "admin_keys": [ADMIN],
                    "shutdown_grace_s": 10, "health_timeout_s": 1,
                    "watchdog": {"interval_s": 0.5, "backoff_initial_s": 0.2, "unhealthy_after": 2}},
        "models": {"tiny": {"engine": engine}},
    }  # fmt: skip
    with leaves_nothing(shm=False):
        server = serve(config, tmp_path)
        try:
            yield server
        finally:
            assert server.stop(signal.SIGTERM, grace_s=30) == 0, server.log(3000)


def _post(server: ServerProcess, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(key), timeout=120)


def _freeze_with_both_in_flight(server: ServerProcess) -> None:
    """A and B each have an ordinary request upstream; then A's frozen one; wait for the restarted engine."""
    old_pid = engine_pid(server)
    answers: list[int] = []
    threads = [threading.Thread(target=lambda k=key: answers.append(_post(server, k, ORDINARY).status_code)) for key in (KEY_A, KEY_B)]
    for thread in threads:
        thread.start()
    restarted_by = time.monotonic() + 90
    wait_until(lambda: sum(w["in_flight"] for w in admin(server, "/admin/workers")["workers"]) >= 2, "the ordinary requests to get upstream", 30, every_s=0.05)
    assert _post(server, KEY_A, FROZEN).status_code in (502, 503)
    for thread in threads:
        thread.join(120)
    assert sorted(answers) != [200, 200], answers  # they were in flight when the engine froze
    wait_engine_replaced(server, old_pid, restarted_by - time.monotonic())


def test_a_key_that_freezes_the_engine_twice_is_refused_and_the_other_key_is_served(keyed: ServerProcess) -> None:
    for _ in range(2):
        _freeze_with_both_in_flight(keyed)
    served = _post(keyed, KEY_B, ORDINARY)
    assert served.status_code == 200, served.text  # B's ordinary shape was in flight at both freezes: not B's doing
    for body in (ORDINARY, FROZEN):  # A's suspects are refused for A (the frozen one never reaches the new engine)
        refused = _post(keyed, KEY_A, body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "request_quarantined", refused.text
    listing = admin(keyed, "/admin/quarantine")["refused"]
    assert listing and all(entry["refused_for"] == ["a"] and not entry["everyone"] for entry in listing), listing
    assert all(set(entry["evidence"]) == {"a"} for entry in listing)
    assert KEY_A not in str(listing) and KEY_B not in str(listing)  # names, never the keys


@pytest.mark.parametrize(
    "path", ["/admin/..%2fready", "/admin/%2e%2e/ready", "/admin/%2E%2E%2Fready", "/admin/%252e%252e%252fready", "/admin/models/..%2f..%2fready", "/admin/.%2fmodels"]
)
def test_the_admin_forwarder_refuses_dot_segments(keyed: ServerProcess, path: str) -> None:
    host, port = keyed.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)  # sends the path as written (httpx would normalise it)
    try:
        connection.request("GET", path, headers=auth(ADMIN))
        answer = connection.getresponse()
        body = answer.read()
    finally:
        connection.close()
    assert answer.status == 400 and b"invalid_admin_path" in body, (path, answer.status, body)
