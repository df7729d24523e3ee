"""A logged model with ``replicas: 2``: the MLflow wrapper runs two engines and spreads its requests.

Without an engine: each replica gets its own shared-engine key (``replicas: 1`` keeps the key it always
had), ``router:`` and a ``url:`` model with replicas are refused, the choice of a replica (fewest in
flight, ties in turn), a failed start of one replica gives up the others, and a clear error once no
replica can be reached.

With the real CPU engine (``engine_sharing: shared``, the default): ``mlflow.pyfunc.load_model`` starts
exactly two engines; plain, concurrent and streamed predictions reach both (each engine's own
``sglang:num_requests_total``); ``sglang-gateway serve --model-uri`` of the same model joins the same two
engines (no start) and balances ``/v1/chat/completions`` and ``/invocations`` over both; one engine
SIGKILLed: every following prediction succeeds on the other, the killed one's host restarts it and it
serves again; ``close`` leaves no engine, host, shared-engine directory or ``/dev/shm`` file. Two engine
starts, plus the restart of the killed one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import mlflow
import pytest

from launch.config import ConfigError, EngineConfig
from launch.engine_dir import STATE_FILE, key_dir_for, read_json
from launch.ports import pick_free_port
from launch.process import EngineError, EngineStartCancelled
from launch.shared import SharedEngine, join
from model_code import close_model, engine_owner, log_model, python_model_of
from model_code.client import EngineClient
from model_code.errors import EngineUnavailableError
from model_code.replica_set import Replica, ReplicaSet
from model_code.target import ModelCodeSettings, resolve_target
from tests.docs.readme_blocks import marked_blocks
from tests.fake_engine import fake_engine_python
from tests.leaks import leaves_nothing
from tests.model_code.helpers import engine_children
from tests.servers import server_process
from tests.waiting import wait_until

MESSAGES = [{"role": "user", "content": "What is Databricks?"}]
BODY = {"messages": MESSAGES, "custom_inputs": {"max_tokens": 4, "temperature": 0.0}}
KEY = "sk-replicas-test"
SETTLE_S = 600  # bound on waiting for a restarted engine (never a timing assertion)


def _engine(tiny_deployment: Any) -> dict[str, Any]:
    engine = tiny_deployment.engine("tiny").model_dump(mode="json", exclude_defaults=True)
    engine["skip_server_warmup"] = True
    return engine


# ------------------------------------------------------------------------------------ without an engine
def test_each_replica_has_its_own_shared_engine_key_and_one_replica_keeps_its_key(tiny_deployment):
    engine = _engine(tiny_deployment)
    one = resolve_target({"models": {"tiny": {"engine": engine}}})
    assert engine_owner.replica_specs(one) == [("tiny", one.engine)]  # the model's own engine, as ever

    two = resolve_target({"models": {"tiny": {"engine": engine, "replicas": 2}}})
    specs = engine_owner.replica_specs(two)
    assert [name for name, _ in specs] == ["tiny", "tiny-1"]
    keys = {key_dir_for(name, config) for name, config in specs}
    assert len(keys) == 2  # two replicas of one config never meet on one engine
    assert all((config.served_model_name or "tiny") == "tiny" for _, config in specs)  # both serve the model's name
    assert key_dir_for(*specs[0]) == key_dir_for("tiny", one.engine)


def test_the_docs_replicas_config_is_a_model_config():
    (block,) = marked_blocks("mlflow-replicas")
    scope: dict[str, Any] = {}
    exec(block.code, scope)  # docs/mlflow.md's own example
    target = resolve_target(scope["config"])
    assert target.entry.replicas == 2 and target.engine is not None


def test_router_and_url_replicas_are_refused(tiny_deployment):
    engine = _engine(tiny_deployment)
    with pytest.raises(ConfigError, match=r"models\.tiny\.router: router is served by `sglang-gateway serve`"):
        resolve_target({"models": {"tiny": {"engine": engine, "replicas": 2, "router": {}}}})
    with pytest.raises(ConfigError, match="replicas, replica_gpus and router need an 'engine' section"):
        resolve_target({"models": {"tiny": {"url": "http://127.0.0.1:1", "replicas": 2}}})


def _url_replicas(count: int) -> list[Replica]:
    settings = ModelCodeSettings(max_retries=0)
    return [Replica(index, f"http://127.0.0.1:{pick_free_port()}", "EMPTY", settings) for index in range(count)]


def test_fewest_in_flight_first_ties_in_turn():
    replicas = ReplicaSet(_url_replicas(3))
    first, second, third = (replicas.take() for _ in range(3))
    assert [r.index for r in (first, second, third)] == [0, 1, 2]  # ties in turn
    replicas.release(second)
    assert replicas.take() is second  # the one with nothing in flight
    assert replicas.take(exclude=first).index in (1, 2)
    for replica in replicas.replicas:
        replica.in_flight = 0
    assert [replicas.take().index for _ in range(4)] == [0, 1, 2, 0]


def test_no_replica_reachable_is_one_clear_error():
    client = EngineClient("tiny", ReplicaSet(_url_replicas(2)), ModelCodeSettings(max_retries=0))
    with pytest.raises(EngineUnavailableError, match="engine is unreachable"):
        client.chat(MESSAGES)  # refused by one, then by the other: one retry, then the error
    with pytest.raises(EngineUnavailableError, match="engine is unreachable"):
        list(client.stream(MESSAGES))
    assert [r.in_flight for r in client.replicas.replicas] == [0, 0]
    client.close()
    with pytest.raises(EngineUnavailableError, match="the client was closed"):
        client.chat(MESSAGES)


def test_one_replica_failing_to_start_gives_up_the_others(tiny_deployment, monkeypatch):
    """A fake ``acquire_engine`` (a start that fails at will is not something the real engine does on
    demand): replica 1 fails at once; replica 0 waits until told to give up, as a real start does."""
    target = resolve_target({"models": {"tiny": {"engine": _engine(tiny_deployment), "replicas": 2}}})
    gave_up = threading.Event()

    def fake_acquire_engine(settings, name, config, *, stop_when=None):
        if name == "tiny-1":
            raise EngineError("replica 1 cannot start", name=name, returncode=1, log_tail=[], log_file=None)
        while not stop_when():
            time.sleep(0.01)
        gave_up.set()
        raise EngineStartCancelled("given up", name=name, returncode=None, log_tail=[], log_file=None)

    monkeypatch.setattr(engine_owner, "acquire_engine", fake_acquire_engine)
    with pytest.raises(EngineError, match="replica 1 cannot start"):
        engine_owner.acquire_engines(target)
    assert gave_up.is_set()


def test_a_shared_start_given_up_stops_its_engine_and_leaves_nothing(tiny_deployment, tmp_path):
    """What a replica's start does when another replica failed: it gives up its lease while the engine is
    starting, and the host, with nobody left, stops that engine and removes its directory. The engine is a FAKE
    one (tests/fake_engine.py, the config's ``python:``) that takes 60 s to listen: a real process of the host,
    given up while it starts; a real engine's shared start, restart and stop are tests/launch/test_shared_engine.py's."""
    fake = {"python": str(fake_engine_python(tmp_path)), "env": {"FAKE_ENGINE_START_S": "60"}}
    config = EngineConfig.model_validate({**_engine(tiny_deployment), **fake})
    key_dir = key_dir_for("tiny-given-up", config)
    seen: dict[str, Any] = {}

    def engine_is_starting() -> bool:
        state = read_json(key_dir / STATE_FILE) or {}
        engines = engine_children(state["host_pid"]) if state.get("host_pid") else []
        if engines:
            seen.update(host_pid=state["host_pid"], engines=engines)
        return bool(engines)

    with leaves_nothing() as check:
        with pytest.raises(EngineStartCancelled, match="start given up"):
            join("tiny-given-up", config, stop_when=engine_is_starting)
        check.watch(seen["host_pid"])
        for pid in seen["engines"]:
            check.watch(pid)
    wait_until(lambda: not key_dir.exists(), f"the shared-engine directory {key_dir} to go", SETTLE_S, every_s=0.5)


# ------------------------------------------------------------------------------------ with real engines
def requests_served(engine: Any) -> float:
    """Requests the engine itself counted (``sglang:num_requests_total``, all label sets summed)."""
    text = httpx.get(f"{engine.url}/metrics", headers=engine.auth_headers(), timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("sglang:num_requests_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def served_counts(engines: list[SharedEngine]) -> list[float]:
    return [requests_served(engine) for engine in engines]


def served_since(engines: list[SharedEngine], before: list[float], sent: int) -> list[float]:
    """Requests each engine counted since ``before``, once they add up to ``sent`` (an engine counts a request
    just after its last chunk went out) or a bound passed."""
    deadline = time.monotonic() + 30
    while True:
        spread = [now - then for now, then in zip(served_counts(engines), before, strict=True)]
        if sum(spread) >= sent or time.monotonic() > deadline:
            return spread
        time.sleep(0.2)


@pytest.fixture(scope="module")
def logged(starts_engine, mlflow_store, tiny_deployment, tiny_model_dir):
    config = {"models": {"tiny": {"engine": _engine(tiny_deployment), "replicas": 2}}, "gateway": {"api_keys": [KEY]}}
    with mlflow.start_run():
        return log_model(config, flavor="chat_agent", model_path=tiny_model_dir)


@pytest.fixture(scope="module")
def _loads(logged):
    """The module's loads of the model (closed at the end, if a test did not close them)."""
    models: list[Any] = []
    yield models
    for model in models:
        close_model(model)


@pytest.fixture
def loaded(logged, _loads):
    """The model loaded once for the module (its two shared engines). The kill test closes it: a test after it
    (in a random order) loads it again (two engine starts) instead of finding it closed."""
    if not _loads or not all(engine.running for engine in python_model_of(_loads[-1]).client.engines):
        _loads.append(mlflow.pyfunc.load_model(logged.model_uri))
    return _loads[-1]


def test_load_starts_two_engines_and_requests_reach_both(loaded):
    engines = python_model_of(loaded).client.engines
    assert len(engines) == 2 and all(isinstance(engine, SharedEngine) for engine in engines)
    assert len({engine.pid for engine in engines}) == 2 and all(engine.running for engine in engines)
    assert len({engine.port for engine in engines}) == 2 and len({engine.key_dir for engine in engines}) == 2
    assert python_model_of(loaded).engine_process is engines[0]

    before = served_counts(engines)
    for _ in range(6):  # one after the other: in turn
        assert loaded.predict(BODY)["messages"][0]["role"] == "assistant"
    with ThreadPoolExecutor(max_workers=4) as pool:  # at the same time: the fewest in flight first
        answers = list(pool.map(lambda _: loaded.predict(BODY), range(8)))
    assert all(answer["messages"][0]["role"] == "assistant" for answer in answers)
    for _ in range(4):
        assert any(chunk["delta"].get("content") for chunk in loaded.predict_stream(BODY))
    spread = served_since(engines, before, 18)
    print(f"requests per replica (the engines' own count): {spread}")
    assert sum(spread) == 18 and min(spread) >= 3, spread


def test_serve_model_uri_joins_the_same_engines_and_balances(loaded, logged, mlflow_store):
    engines = python_model_of(loaded).client.engines
    pids = [engine.pid for engine in engines]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{mlflow_store}/mlflow.db"}
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--model-uri", logged.model_uri, "--port", "{port}"]
    auth = {"Authorization": f"Bearer {KEY}"}
    with server_process(argv, log_path=mlflow_store / "serve-replicas.log", env=env, ready_path="/health") as server:
        assert [read_json(engine.key_dir / STATE_FILE)["engine_pid"] for engine in engines] == pids  # no new engine
        ready = httpx.get(f"{server.url}/ready", timeout=30).json()
        assert ready["models"]["tiny"] == {"ready": True, "replicas_ready": 2}, ready

        before = served_counts(engines)
        chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 32, "ignore_eos": True}
        with ThreadPoolExecutor(max_workers=8) as pool:  # the gateway's least busy replica: ties go to replica 0
            responses = list(
                pool.map(
                    lambda _: httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=auth, timeout=120),
                    range(8),
                )
            )
        for response in responses:
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["role"] == "assistant"
        through_gateway = served_since(engines, before, 8)
        middle = served_counts(engines)
        for _ in range(4):
            response = httpx.post(f"{server.url}/invocations", json=BODY, headers=auth, timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["messages"][0]["role"] == "assistant"
        through_invocations = served_since(engines, middle, 4)
    print(f"per replica: /v1/chat/completions {through_gateway}, /invocations {through_invocations}")
    assert min(through_gateway) >= 1 and min(through_invocations) >= 1
    assert [engine.pid for engine in engines] == pids and all(engine.running for engine in engines)


def test_one_engine_killed_the_other_serves_then_close_leaves_nothing(loaded):
    client = python_model_of(loaded).client
    engines = client.engines
    with leaves_nothing() as check:
        for engine in engines:
            check.watch(engine.pid)
            check.watch(engine.host_pid)
        killed = engines[1]
        key_dir, old_pid, old_url = killed.key_dir, killed.pid, killed.url
        survivor_before = requests_served(engines[0])
        os.kill(old_pid, signal.SIGKILL)
        for _ in range(6):  # the killed replica refuses: each request goes to the other one
            assert loaded.predict(BODY)["messages"][0]["role"] == "assistant"
        assert served_since(engines[:1], [survivor_before], 6) == [6]

        # the killed engine's host starts it again; once it answers it takes requests again
        state = wait_until(
            lambda: (now := read_json(key_dir / STATE_FILE) or {}).get("status") == "ready" and now.get("engine_pid") not in (None, old_pid) and now,
            lambda: f"the killed replica was not restarted: {read_json(key_dir / STATE_FILE)}", SETTLE_S, every_s=1,
        )  # fmt: skip
        check.watch(state["engine_pid"])
        assert state["url"] == old_url  # its old port again: URLs held by others (serve --model-uri) stay valid
        for _ in range(60):
            loaded.predict(BODY)
            if killed.pid == state["engine_pid"] and requests_served(killed) > 0:
                break
            time.sleep(1)
        assert killed.pid == state["engine_pid"] and requests_served(killed) > 0, (
            "the restarted replica serves no request"
        )
        key_dirs = [engine.key_dir for engine in engines]

        close_model(loaded)
        assert not any(engine.running for engine in engines)
    wait_until(  # each host removes its shared-engine directory once its engine stopped
        lambda: not any(path.exists() for path in key_dirs), f"the shared-engine directories {key_dirs} to go", SETTLE_S, every_s=0.5
    )
    with pytest.raises(EngineUnavailableError, match="the client was closed"):
        loaded.predict(BODY)
