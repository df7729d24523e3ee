"""A file or batch id with a NUL (``GET /v1/files/x%00``) names nothing the gateway made: a 404 in the route's
dialect, on SQLite and on PostgreSQL (whose text cannot hold a NUL: the lookup itself failed, a 500, before)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.gateway.helpers import assert_openai_error
from tests.gateway_server import KEY, auth, serve


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
@pytest.mark.parametrize(("path", "code"), [("/v1/files/x%00", "file_not_found"), ("/v1/files/x%00/content", "file_not_found"),
                                            ("/v1/batches/b%00", "batch_not_found")])  # fmt: skip
def test_an_id_with_nul_is_not_found(database: str, path: str, code: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    usage = {} if database == "sqlite" else {"database_url": request.getfixturevalue("postgres").url}
    gateway = {"api_keys": [KEY], "state_dir": str(tmp_path / "state"), "usage": usage}
    with serve({"m": {"url": "http://127.0.0.1:9"}}, gateway) as server:
        response = httpx.get(server.url + path, headers=auth(), timeout=30)
        assert_openai_error(response, 404, code)
