"""The status page's files as the gateway serves them (no engine: a model whose URL nobody listens on).

What the page shows is driven in a real browser against a real engine in tests/gateway/test_swap.py (j).
Here: the page and its files need no key while the API they call still does, they carry a policy that lets
only the page's own scripts run, nothing outside ``gateway/ui/static`` is served, and ``status_page: false``
turns all of it off.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.gateway.helpers import assert_openai_error, closed_port_url
from tests.gateway_server import KEY, auth, serve

ADMIN = "page-admin-key"


@pytest.fixture(scope="module")
def keyed() -> httpx.Client:
    with serve({"m": {"url": closed_port_url()}}, {"api_keys": [KEY], "admin_keys": [ADMIN]}) as server:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            yield http


def test_page_and_its_files_need_no_key_but_the_api_still_does(keyed: httpx.Client) -> None:
    page = keyed.get("/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe-inline" not in policy
    assert keyed.head("/").status_code == 200
    files = re.findall(r'(?:src|href)="(/ui/[^"]+)"', page.text)
    assert sorted(files) == ["/ui/metrics.js", "/ui/playground.js", "/ui/status.js", "/ui/style.css"]
    for path in files:
        served = keyed.get(path)
        kind = "text/javascript" if path.endswith(".js") else "text/css"
        assert served.status_code == 200 and served.headers["content-type"] == f"{kind}; charset=utf-8", path
        assert served.headers["x-content-type-options"] == "nosniff"
    assert "<script>" not in page.text, "an inline script would need 'unsafe-inline'"
    assert not re.search(r"<[^>]*\son[a-z]+=", page.text), "inline handlers would need 'unsafe-inline'"
    assert_openai_error(keyed.get("/v1/models"), 401, "missing_api_key")
    assert_openai_error(keyed.get("/metrics"), 401, "missing_api_key")
    assert_openai_error(keyed.get("/admin/models"), 401, "missing_api_key")
    assert_openai_error(keyed.get("/admin/models", headers=auth(KEY)), 401, "invalid_api_key")  # a client key is not an admin key
    assert keyed.get("/admin/models", headers=auth(ADMIN)).status_code == 200


@pytest.mark.parametrize("path", ["/ui/nope.js", "/ui/..%2Fapp.py", "/ui/%2E%2E%2Fconfig.py", "/ui/.hidden.js", "/ui/", "/ui/routes.py"])
def test_nothing_but_the_pages_files_is_served(keyed: httpx.Client, path: str) -> None:
    response = keyed.get(path)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found", response.text


def test_status_page_false_turns_it_off() -> None:
    with serve({"m": {"url": closed_port_url()}}, {"status_page": False}) as server:
        assert_openai_error(httpx.get(server.url + "/", timeout=30), 404)
        assert_openai_error(httpx.get(server.url + "/ui/status.js", timeout=30), 404)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
