"""With ``engine_sharing: per_process``, each flavour starts its own engine through
``mlflow.pyfunc.load_model`` (weights from the logged artifact), answers, and leaves no engine behind
after ``close``. The shared mode is tested in ``test_shared_serving.py``.

One real SGLang CPU engine start for the module: a ``chat_agent`` loads its engine, the output shows the
start phases and the URL but not the engine's own lines, it answers (plain, streamed, traced; with the LoRA
adapter packed with the model, selected by ``custom_inputs``, and without) and ``close`` leaves nothing. What only the model's engine ownership decides (two loads in one process side by side on
their own ports, ``show_engine_log``, closing each, ``stop_all``, the ``responses_agent`` flavour on a managed
engine) runs on FAKE engines (tests/fake_engine.py, the engine config's ``python:``), which the product
starts, watches and stops exactly as real ones: each flavour against the real engine is tested in URL mode
(``test_flavors_url.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import pytest
from loguru import logger

from model_code import close_model, engine_owner, log_model, python_model_of, stop_all
from model_code.errors import BadRequestError, EngineUnavailableError
from tests.fake_engine import fake_engine_python
from tests.leaks import leaves_nothing
from tests.lora import make_adapter
from tests.model_code.helpers import engine_children, last_trace

MESSAGES = [{"role": "user", "content": "What is Databricks?"}]


def _log(engine: dict, flavors: dict[str, bool], model_path: Path, adapters: dict[str, str] | None = None) -> dict:
    """Log each flavour (-> its ``show_engine_log``) in ``per_process`` mode with the engine section ``engine``."""
    config = {"models": {"tiny": {"engine": {**engine, "skip_server_warmup": True}, **({"adapters": adapters} if adapters else {})}}}
    infos = {}
    for flavor, show in flavors.items():
        settings = {"engine_sharing": "per_process", "show_engine_log": show}
        with mlflow.start_run():
            infos[flavor] = log_model(config, flavor=flavor, model_path=model_path, settings=settings)
    return infos


def _tiny_engine(tiny_deployment) -> dict:
    return tiny_deployment.engine("tiny").model_dump(mode="json", exclude_defaults=True)


@pytest.fixture(scope="module")
def managed_info(starts_engine, mlflow_store, tiny_deployment, tiny_model_dir, tmp_path_factory):
    """A ``chat_agent`` on the real engine, logged with a LoRA adapter whose directory is gone once it is logged
    (the model serves its packed copy)."""
    source = make_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "support", seed=1)
    info = _log(_tiny_engine(tiny_deployment), {"chat_agent": False}, tiny_model_dir, {"support": str(source)})["chat_agent"]
    shutil.rmtree(source)
    yield info
    stop_all()


@pytest.fixture(scope="module")
def fake_infos(mlflow_store, tiny_deployment, tiny_model_dir, tmp_path_factory):
    """The three flavours on the FAKE engine (``chat_model`` with ``show_engine_log``)."""
    python = fake_engine_python(tmp_path_factory.mktemp("fake-engine"))
    engine = {**_tiny_engine(tiny_deployment), "python": str(python)}
    yield _log(engine, {"chat_agent": False, "chat_model": True, "responses_agent": False}, tiny_model_dir)
    stop_all()


def _load_logged(uri: str) -> tuple[object, list[str]]:
    """``load_model(uri)`` and what it logged at INFO."""
    shown: list[str] = []
    sink = logger.add(lambda message: shown.append(message.record["message"]), level="INFO")
    try:
        return mlflow.pyfunc.load_model(uri), shown
    finally:
        logger.remove(sink)


def test_a_managed_model_starts_its_real_engine_answers_then_close_leaves_nothing(managed_info):
    before = set(engine_children())
    with leaves_nothing() as check:  # no engine process and no /dev/shm file once it is closed
        agent, quiet = _load_logged(managed_info.model_uri)
        engine = python_model_of(agent).engine_process
        check.watch(engine.pid)
        try:
            # quiet by default: phases and the URL, not the engine's own lines
            assert any("ready at http://" in line for line in quiet) and any(": loading weights (" in line for line in quiet)
            assert not any(line.startswith("[tiny]") for line in quiet)
            assert engine.ready and set(engine_children()) - before == {engine.pid}
            assert engine in engine_owner.live_engines()

            out = agent.predict({"messages": MESSAGES, "custom_inputs": {"temperature": 0.1, "max_tokens": 20}})
            assert out["messages"][0]["role"] == "assistant" and out["usage"]["completion_tokens"] > 0
            assert last_trace().info.token_usage["output_tokens"] == out["usage"]["completion_tokens"]
            chunks = list(
                agent.predict_stream({"messages": MESSAGES, "custom_inputs": {"temperature": 0.0, "max_tokens": 8}})
            )
            assert any(c.get("finish_reason") for c in chunks)

            # the adapter packed with the model, selected per request through custom_inputs
            assert any(arg.endswith("/artifacts/lora-support") for arg in engine.argv), engine.argv
            greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
            base = agent.predict({"messages": MESSAGES, "custom_inputs": greedy})["messages"][0]["content"]
            tuned = agent.predict({"messages": MESSAGES, "custom_inputs": {**greedy, "adapter": "support"}})
            assert tuned["messages"][0]["content"] != base, base
            streamed = agent.predict_stream({"messages": MESSAGES, "custom_inputs": {**greedy, "adapter": "support"}})
            assert "".join(c["delta"].get("content") or "" for c in streamed) == tuned["messages"][0]["content"]
            with pytest.raises(BadRequestError, match="adapter 'other': not an adapter of model 'tiny' .its adapters: support"):
                agent.predict({"messages": MESSAGES, "custom_inputs": {"adapter": "other"}})
        finally:
            close_model(agent)
    assert not engine.running
    assert set(engine_children()) == before
    with pytest.raises(EngineUnavailableError, match="the client was closed"):
        agent.predict({"messages": MESSAGES})


def test_two_managed_models_side_by_side_then_none_left(fake_infos):
    before = set(engine_children())
    with leaves_nothing() as check:  # no engine process and no /dev/shm file once both are closed
        agent, quiet = _load_logged(fake_infos["chat_agent"].model_uri)
        chat, shown = _load_logged(fake_infos["chat_model"].model_uri)
        engines = [python_model_of(agent).engine_process, python_model_of(chat).engine_process]
        for engine in engines:
            check.watch(engine.pid)
        try:
            # show_engine_log adds the engine's own lines (the fake's first one names it), quiet leaves them out
            assert any("ready at http://" in line for line in quiet)
            assert not any(line.startswith("[tiny]") for line in quiet)
            assert any(line.startswith("[tiny]") and "fake engine (tests/fake_engine.py)" in line for line in shown)
            assert all(e is not None and e.ready for e in engines)
            assert engines[0].port != engines[1].port
            assert set(engine_children()) - before == {e.pid for e in engines}
            assert set(engine_owner.live_engines()) >= set(engines)

            out = agent.predict({"messages": MESSAGES, "custom_inputs": {"max_tokens": 3}})
            assert out["messages"][0]["content"] == "tok tok tok " and out["usage"]["completion_tokens"] == 3
            out = chat.predict({"messages": MESSAGES, "max_tokens": 2})
            assert out["choices"][0]["message"]["content"] == "tok tok "
            assert [c for chunk in chat.predict_stream({"messages": MESSAGES, "max_tokens": 2}) for c in chunk["choices"]]

            close_model(agent)  # one closed: its engine stops, the other one serves on
            assert not engines[0].running and engines[1].running
            assert set(engine_children()) - before == {engines[1].pid}
            assert chat.predict({"messages": MESSAGES, "max_tokens": 1})["choices"][0]["message"]["content"] == "tok "
        finally:
            close_model(agent)
            close_model(chat)
    assert not any(engine.running for engine in engines)
    assert set(engine_children()) == before
    with pytest.raises(EngineUnavailableError, match="the client was closed"):
        agent.predict({"messages": MESSAGES})


def test_responses_agent_managed_then_stop_all(fake_infos):
    before = set(engine_children())
    with leaves_nothing() as check:
        model = mlflow.pyfunc.load_model(fake_infos["responses_agent"].model_uri)
        engine = python_model_of(model).engine_process
        check.watch(engine.pid)
        stopped = None
        try:
            assert set(engine_children()) - before == {engine.pid}
            out = model.predict({"input": MESSAGES, "max_output_tokens": 2})
            assert out["output"][0]["type"] == "message" and out["usage"]["output_tokens"] == 2
            assert out["output"][0]["content"][0]["text"] == "tok tok "
            events = list(model.predict_stream({"input": MESSAGES, "max_output_tokens": 2}))
            assert events[-1]["type"] == "response.completed"
        finally:
            stopped = stop_all()  # the module-level switch stops it too
        assert stopped == 1
    assert not engine.running
    assert set(engine_children()) == before
