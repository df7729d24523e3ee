"""Who reads what of /metrics: a client key its own models and itself; the admin and metrics keys (this one
from a file, as Prometheus' ``authorization.credentials_file`` holds it) everything; an open gateway everyone.
In-process gateways in front of a FAKE engine (tests/fake_engine.py): the counters come from real requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.core.metrics_scope import scoped_exposition
from tests.chat import CHAT, chat_body
from tests.fake_engine import running_fake_engine
from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import auth, serve

KEY_MINE, KEY_OTHER, ADMIN, METRICS = "key-of-mine-tenant", "key-of-other-tenant", "metrics-admin-key", "prometheus-scrape-key"


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_fake_engine(tmp_path_factory.mktemp("fake")) as url:
        yield url


def _chat(http: httpx.Client, key: str | None, model: str) -> None:
    assert http.post(CHAT, json=chat_body(model), headers=auth(key) if key else {}).status_code == 200


def test_a_client_key_reads_its_own_part_and_the_admin_and_metrics_keys_all(engine_url: str, tmp_path: Path) -> None:
    metrics_file = tmp_path / "metrics.key"
    metrics_file.write_text(f"# for prometheus\n{METRICS}\n")
    gateway = {
        "keys": [{"name": "mine", "key": KEY_MINE, "models": ["mine"]}, {"name": "other", "key": KEY_OTHER, "models": ["other"]}],
        "admin_keys": [ADMIN], "metrics_key_file": str(metrics_file),
    }  # fmt: skip
    with serve({"mine": {"url": engine_url}, "other": {"url": engine_url}}, gateway) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        _chat(http, KEY_MINE, "mine")
        _chat(http, KEY_OTHER, "other")
        own = http.get("/metrics", headers=auth(KEY_MINE))
        assert own.status_code == 200
        assert 'key="mine"' in own.text and 'model="mine"' in own.text
        assert 'key="other"' not in own.text and 'model="other"' not in own.text
        for key in (ADMIN, METRICS):
            full = http.get("/metrics", headers=auth(key))
            assert full.status_code == 200, full.text
            assert all(part in full.text for part in ('key="mine"', 'key="other"', 'model="other"'))
        assert_openai_error(http.get("/metrics"), 401)
        assert_openai_error(http.get("/metrics", headers=auth("wrong")), 401)
        assert_openai_error(http.get("/v1/models", headers=auth(METRICS)), 401)  # the metrics key reads /metrics only
        assert_openai_error(http.get("/admin/models", headers=auth(METRICS)), 401)


def test_an_open_gateway_keeps_open_metrics(engine_url: str) -> None:
    with serve({"mine": {"url": engine_url}, "other": {"url": engine_url}}, {}) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        _chat(http, None, "other")
        scrape = http.get("/metrics")
        assert scrape.status_code == 200 and 'model="other"' in scrape.text


def test_the_scrape_is_filtered_by_name_and_labels() -> None:
    text = (
        b"# HELP sglang:num_running_reqs The number of running requests.\n# TYPE sglang:num_running_reqs gauge\n"
        b'sglang:num_running_reqs{model_name="m"} 1.0\n'
        b"# HELP gateway_key_requests_total Requests by client key.\n# TYPE gateway_key_requests_total counter\n"
        b'gateway_key_requests_total{key="a",model="mine",status_class="2xx"} 3.0\n'
        b'gateway_key_requests_total{key="b",model="mine",status_class="2xx"} 1.0\n'
        b'gateway_key_requests_total{key="a\\"b",model="mine",status_class="2xx"} 1.0\n'
        b'gateway_engine_up{model="mine"} 1.0\ngateway_engine_up{model="other"} 1.0\ngateway_engine_up{model="mine:adapter"} 1.0\n'
        b"process_open_fds 12.0\n"
    )
    scoped = scoped_exposition(text, "a", lambda label: label.partition(":")[0] == "mine").decode()
    assert "sglang:" not in scoped
    assert 'key="a",model="mine"' in scoped and 'key="b"' not in scoped and 'key="a\\"b"' not in scoped
    assert 'model="mine"}' in scoped and 'model="mine:adapter"' in scoped and 'model="other"' not in scoped
    assert "process_open_fds 12.0" in scoped and "# TYPE gateway_key_requests_total counter" in scoped
    assert "key=" not in scoped_exposition(text, None, lambda label: True).decode()  # a plain key: no per-key series
