"""The stored-response index on its own: ownership, the bound, persistence across reopening; the key
identity the auth middleware hands to routes; where a deployment's state lives; backend identities."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from gateway.config import default_state_dir, gateway_settings
from gateway.core.backends import EngineBackend, UrlBackend
from gateway.core.registry import ModelRoute
from gateway.core.responses_index import FILE_NAME, ResponseIndex, StoredResponse, open_response_index
from gateway.edge.auth import OPEN_OWNER, OWNER_SCOPE_KEY, AuthMiddleware, KeyHolder, key_owner, key_policy
from launch.config import EngineConfig, parse_config
from launch.process import EngineProcess

A, B = key_owner(b"key-a"), key_owner(b"key-b")


@pytest.fixture(params=["memory", "file"])
def index(request: pytest.FixtureRequest, tmp_path: Path) -> ResponseIndex:
    return ResponseIndex(tmp_path / FILE_NAME if request.param == "file" else None, max_entries=3)


def test_a_response_is_found_for_its_owner_only(index: ResponseIndex) -> None:
    index.record("resp_1", "tiny", "url:http://e", A)
    found = index.find("resp_1", A)
    assert found is not None and (found.model, found.backend, found.owner) == ("tiny", "url:http://e", A)
    assert index.find("resp_1", B) is None and index.find("resp_1", OPEN_OWNER) is None
    assert index.find("resp_2", A) is None
    index.record("resp_1", "other", "url:http://x", B)  # the first record of an id wins: never handed over
    assert index.find("resp_1", B) is None and index.find("resp_1", A) == found
    index.close()


def test_the_oldest_are_forgotten_first(index: ResponseIndex) -> None:
    for n in range(5):
        index.record(f"resp_{n}", "tiny", "url:http://e", A)
    assert len(index) == 3
    assert [n for n in range(5) if index.find(f"resp_{n}", A)] == [2, 3, 4]
    index.close()


def test_the_file_outlives_the_process_and_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "state" / FILE_NAME
    first = ResponseIndex(path, max_entries=3)
    for n in range(5):
        first.record(f"resp_{n}", "tiny", "url:http://e", A if n % 2 else B)
    first.close()
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    again = ResponseIndex(path, max_entries=3)  # a restarted gateway: nothing in memory, all from the file
    assert [n for n in range(5) if again.find(f"resp_{n}", A if n % 2 else B)] == [2, 3, 4]
    assert again.find("resp_3", B) is None and again.find("resp_4", A) is None  # owners survive too
    again.record("resp_9", "tiny", "url:http://e", A)
    again.flush()
    rows = sqlite3.connect(path).execute("SELECT id FROM responses ORDER BY seq").fetchall()
    assert [row[0] for row in rows] == ["resp_3", "resp_4", "resp_9"]
    again.close()


def test_a_worker_answers_a_created_response_only_once_the_other_workers_can_read_it(tmp_path: Path) -> None:
    """With worker processes, :meth:`ResponseIndex.publish` returns once the entry is in the file (another worker
    may get the next request for it); here the file is locked by a third party, so the writer must wait."""
    path = tmp_path / FILE_NAME
    worker, other = ResponseIndex(path), ResponseIndex(path)
    worker.shared = True
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")

    async def scenario() -> None:
        publishing = asyncio.ensure_future(worker.publish("resp_1", "tiny", "engine-a", "alice"))
        await asyncio.sleep(0.3)
        assert not publishing.done()  # not answered while the entry cannot be written
        blocker.execute("ROLLBACK")
        await asyncio.wait_for(publishing, 5)
        assert other.find("resp_1", "alice") == StoredResponse("tiny", "engine-a", "alice")

    try:
        asyncio.run(scenario())
    finally:
        blocker.close()
        worker.close()
        other.close()


def test_an_unusable_state_dir_fails_the_start_with_its_name(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match=r"^gateway.state_dir: cannot open the responses index in .*file"):
        open_response_index(blocker)
    assert open_response_index(None).path is None  # no state dir: memory only


# ------------------------------------------------------------------ who is calling
def _owner_seen(holder: KeyHolder, headers: list[tuple[bytes, bytes]], path: str = "/v1/responses") -> Any:
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen["owner"] = scope.get(OWNER_SCOPE_KEY, "unset")

    async def send(message: dict[str, Any]) -> None:
        seen.setdefault("status", message.get("status"))

    import asyncio

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(AuthMiddleware(app, holder=holder)(scope, None, send))  # type: ignore[arg-type]
    return seen.get("owner", seen.get("status"))


def test_the_auth_middleware_names_the_matching_key_never_the_key() -> None:
    holder = KeyHolder(key_policy((b"key-a", b"key-b"), (b"admin",), ["/health"]))
    assert _owner_seen(holder, [(b"authorization", b"Bearer key-a")]) == A
    assert _owner_seen(holder, [(b"authorization", b"Bearer key-b")]) == B
    assert _owner_seen(holder, [(b"authorization", b"Bearer key-c")]) == 401
    assert A != B and A.startswith("key:") and "key-a" not in A and key_owner(b"key-a") == A  # stable, not the key
    holder.policy = key_policy((b"key-b", b"key-new"), (), [])  # a reload keeps the identity of a key it keeps
    assert _owner_seen(holder, [(b"authorization", b"Bearer key-b")]) == B
    open_gateway = KeyHolder(key_policy((), (), []))
    assert _owner_seen(open_gateway, []) == OPEN_OWNER  # no client keys: one shared owner


# ------------------------------------------------------------------ where the state lives
def test_the_default_state_dir_is_one_per_deployment_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "one").mkdir()
    for name in ("one/deploy.yaml", "deploy.yaml"):
        (tmp_path / name).write_text("models: {}\n")
    one, other = default_state_dir(tmp_path / "one" / "deploy.yaml"), default_state_dir(tmp_path / "deploy.yaml")
    assert one.parent == tmp_path / "xdg" / "sglang-gateway" and one.name.startswith("deploy-") and one != other
    monkeypatch.chdir(tmp_path)
    assert default_state_dir(Path("one/deploy.yaml")) == one  # the same file, named relatively: the same state
    assert default_state_dir("models:/chat/3").name.startswith("3-")  # a model URI: keyed by the URI

    models = {"m": {"url": "http://127.0.0.1:1"}}
    assert gateway_settings(parse_config({"models": models}, tmp_path / "deploy.yaml")).state_dir == other
    relative = parse_config({"models": models, "gateway": {"state_dir": "state"}}, tmp_path / "one" / "deploy.yaml")
    assert gateway_settings(relative).state_dir == tmp_path / "one" / "state"  # relative to the config file
    assert gateway_settings(parse_config({"models": models})).state_dir is None  # built in memory: memory only


def test_url_backends_are_named_by_url_and_managed_ones_by_instance(tiny_engine_config: EngineConfig) -> None:
    one, same = UrlBackend("m", "http://127.0.0.1:9"), UrlBackend("m", "http://127.0.0.1:9", api_key="k")
    assert one.identity == same.identity == "url:http://127.0.0.1:9"  # a restarted gateway finds its external engine
    engine = EngineProcess("m", tiny_engine_config)  # never started
    managed, restarted = EngineBackend("m", engine), EngineBackend("m", engine)
    assert managed.identity != restarted.identity and "127.0.0.1" not in managed.identity
    route = ModelRoute("m", (one,))
    assert route.backend_named(same.identity) is one and route.backend_named(managed.identity) is None


class _Remote:
    """A shared store's side, in memory (gateway.core.shared_responses over PostgreSQL is tested with two replicas)."""

    def __init__(self) -> None:
        self.rows: dict[str, StoredResponse] = {}
        self.soon: list[str] = []
        self.down = False

    async def publish(self, response_id: str, stored: StoredResponse) -> None:
        self.rows.setdefault(response_id, stored)

    def publish_soon(self, response_id: str, stored: StoredResponse) -> None:
        self.soon.append(response_id)
        self.rows.setdefault(response_id, stored)

    async def find(self, response_id: str) -> StoredResponse | None:
        if self.down:
            raise ConnectionError("store down")
        return self.rows.get(response_id)


def test_replicas_publish_new_ids_and_look_up_the_store_on_a_local_miss() -> None:
    remote = _Remote()
    mine, theirs = ResponseIndex(), ResponseIndex()
    mine.remote = theirs.remote = remote

    async def scenario() -> None:
        await mine.publish("resp_plain", "tiny", "url:http://e", A)  # a plain answer: in the store before its id leaves
        mine.record("resp_stream", "tiny", "url:http://e", A)  # a stream's id: published in a task
        mine.record("resp_stream", "tiny", "url:http://e", B)  # known already: not published again
        assert remote.soon == ["resp_stream"] and set(remote.rows) == {"resp_plain", "resp_stream"}
        found = await theirs.find_shared("resp_plain", A)
        assert found is not None and found.backend == "url:http://e"
        assert await theirs.find_shared("resp_stream", B) is None  # another key's: the same None as an unknown id
        assert await theirs.find_shared("resp_nobody", A) is None
        remote.down = True
        assert await theirs.find_shared("resp_plain", A) is not None  # looked up once: known here now
        assert await mine.find_shared("resp_stream", A) is not None  # its own: never asks the store
        with pytest.raises(ConnectionError):  # unknown here and the store down: said, never a wrong None
            await theirs.find_shared("resp_other", A)

    asyncio.run(scenario())
