"""With ``engine_sharing: per_process``, each flavour starts its own engine through
``mlflow.pyfunc.load_model`` (weights from the logged artifact), answers, and leaves no engine behind
after ``close``. Two loads in one process run side by side on different ports. Slow (one engine start
per flavour): one module, each model loaded once. The shared mode is tested in ``test_shared_serving.py``."""

from __future__ import annotations

import mlflow
import pytest
from loguru import logger

from model_code import close_model, engine_owner, log_model, python_model_of, stop_all
from model_code.errors import EngineUnavailableError
from tests.leaks import leaves_nothing
from tests.model_code.helpers import engine_children, last_trace

MESSAGES = [{"role": "user", "content": "What is Databricks?"}]


@pytest.fixture(scope="module")
def managed_infos(starts_engine, mlflow_store, tiny_deployment, tiny_model_dir):
    config = {
        "models": {"tiny": {"engine": tiny_deployment.engine("tiny").model_dump(mode="json", exclude_defaults=True)}}
    }
    config["models"]["tiny"]["engine"]["skip_server_warmup"] = True
    infos = {}
    for flavor in ("chat_agent", "chat_model", "responses_agent"):
        settings = {"engine_sharing": "per_process", "show_engine_log": flavor == "chat_model"}
        with mlflow.start_run():
            infos[flavor] = log_model(config, flavor=flavor, model_path=tiny_model_dir, settings=settings)
    yield infos
    stop_all()


def test_two_managed_models_side_by_side_then_none_left(managed_infos):
    before = set(engine_children())
    shown: list[str] = []
    with leaves_nothing() as check:  # no engine process and no /dev/shm file once both are closed
        sink = logger.add(lambda message: shown.append(message.record["message"]), level="INFO")
        try:
            agent = mlflow.pyfunc.load_model(managed_infos["chat_agent"].model_uri)
            quiet, shown[:] = list(shown), []
            chat = mlflow.pyfunc.load_model(managed_infos["chat_model"].model_uri)
        finally:
            logger.remove(sink)
        # quiet by default: phases and the URL, not the engine's own lines; show_engine_log adds them
        assert any("ready at http://" in line for line in quiet) and any(": loading weights (" in line for line in quiet)
        assert not any(line.startswith("[tiny]") for line in quiet)
        assert any(line.startswith("[tiny]") and "server_args=" in line for line in shown)
        engines = [python_model_of(agent).engine_process, python_model_of(chat).engine_process]
        for engine in engines:
            check.watch(engine.pid)
        try:
            assert all(e is not None and e.ready for e in engines)
            assert engines[0].port != engines[1].port
            assert set(engine_children()) - before == {e.pid for e in engines}
            assert set(engine_owner.live_engines()) >= set(engines)

            out = agent.predict({"messages": MESSAGES, "custom_inputs": {"temperature": 0.1, "max_tokens": 20}})
            assert out["messages"][0]["role"] == "assistant" and out["usage"]["completion_tokens"] > 0
            assert last_trace().info.token_usage["output_tokens"] == out["usage"]["completion_tokens"]
            chunks = list(
                agent.predict_stream({"messages": MESSAGES, "custom_inputs": {"temperature": 0.0, "max_tokens": 8}})
            )
            assert any(c.get("finish_reason") for c in chunks)

            out = chat.predict({"messages": MESSAGES, "temperature": 0.0, "max_tokens": 8})
            assert out["choices"][0]["message"]["role"] == "assistant"
            assert [c for chunk in chat.predict_stream({"messages": MESSAGES, "max_tokens": 8}) for c in chunk["choices"]]
        finally:
            close_model(agent)
            close_model(chat)
    assert not any(engine.running for engine in engines)
    assert set(engine_children()) == before
    with pytest.raises(EngineUnavailableError, match="the client was closed"):
        agent.predict({"messages": MESSAGES})


def test_responses_agent_managed(managed_infos):
    before = set(engine_children())
    with leaves_nothing() as check:
        model = mlflow.pyfunc.load_model(managed_infos["responses_agent"].model_uri)
        check.watch(python_model_of(model).engine_process.pid)
        stopped = None
        try:
            out = model.predict({"input": MESSAGES, "max_output_tokens": 8, "temperature": 0.0})
            assert out["output"][0]["type"] == "message" and out["usage"]["output_tokens"] > 0
            events = list(model.predict_stream({"input": MESSAGES, "max_output_tokens": 8, "temperature": 0.0}))
            assert events[-1]["type"] == "response.completed"
        finally:
            stopped = stop_all()  # the module-level switch stops it too
        assert stopped == 1
    assert set(engine_children()) == before
