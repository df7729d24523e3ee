"""Keys are never logged: client keys (from the YAML, an environment variable and a file), admin
keys, a url model's upstream key, a key presented but wrong, and the key the MLflow wrapper reads
from ``mlflow.api_key_env``.

Every log record the process writes while a gateway with all of them configured serves traffic,
rejects bad keys, lists its models and reloads (rotating the upstream key) is captured at DEBUG
level: loguru's records with their bound fields (what a JSON log shipper sees) and the standard
``logging`` records (uvicorn, httpx, openai).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from loguru import logger

from gateway.app import app_from_config
from launch.config import load_config
from launch.process import EngineProcess
from model_code.client import EngineClient
from model_code.errors import AuthenticationError
from tests.gateway_server import GatewayServer, auth

SECRETS = {
    "yaml client key": "sk-yaml-5f0c1e9a7b",
    "env client key": "sk-env-81d2c4f6a3",
    "file client key": "sk-file-3b7e9d2c14",
    "admin key": "adm-6c4a1f8e2d",
    "upstream key": "up-9e3b5d7a1c",
    "rotated upstream key": "up-rotated-2a8c4e6f0b",
    "wrong key presented": "sk-wrong-7d1f3b5e9a",
    "mlflow api_key_env key": "sk-env-81d2c4f6a3",  # the wrapper authenticates with the env client key
}
HELLO = [{"role": "user", "content": "hi"}]


class LogCapture(logging.Handler):
    """Every standard ``logging`` record, formatted with its arguments, appended to ``lines``."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture()
def captured_logs() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="DEBUG", serialize=True)
    handler = LogCapture(lines)
    root = logging.getLogger()
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.remove(sink)
        root.removeHandler(handler)
        root.setLevel(previous_level)


def _deployment(engine_url: str, key_file: Path, upstream_key: str) -> dict:
    return {
        "models": {"tiny": {"url": engine_url, "api_key": upstream_key, "aliases": ["default"]}},
        "gateway": {
            "api_keys": [SECRETS["yaml client key"]],
            "api_keys_env": "GW_TEST_SECRET_KEYS",
            "api_keys_file": str(key_file),
            "admin_keys": [SECRETS["admin key"]],
            "log_requests": True,
        },
    }


def test_no_key_reaches_the_logs(
    tiny_engine: EngineProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, captured_logs: list[str]
) -> None:
    monkeypatch.setenv("GW_TEST_SECRET_KEYS", SECRETS["env client key"])
    key_file = tmp_path / "keys.txt"
    key_file.write_text(f"# client keys\n{SECRETS['file client key']}\n")
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump(_deployment(tiny_engine.url, key_file, SECRETS["upstream key"])))
    app, settings = app_from_config(load_config(config))
    server = GatewayServer(app, settings).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            chat = {"model": "tiny", "messages": HELLO, "max_tokens": 2}
            for name in ("yaml client key", "env client key", "file client key"):
                assert http.post("/v1/chat/completions", json=chat, headers=auth(SECRETS[name])).status_code == 200, (
                    name
                )
            wrong = SECRETS["wrong key presented"]
            assert http.post("/v1/chat/completions", json=chat, headers=auth(wrong)).status_code == 401
            assert http.get("/v1/models", headers={"Authorization": f"Basic {wrong}"}).status_code == 401
            assert http.get("/admin/models", headers=auth(wrong)).status_code == 401
            listing = http.get("/admin/models", headers=auth(SECRETS["admin key"]))
            assert listing.status_code == 200 and SECRETS["upstream key"] not in listing.text
            config.write_text(yaml.safe_dump(_deployment(tiny_engine.url, key_file, SECRETS["rotated upstream key"])))
            reload = http.post("/admin/reload", headers=auth(SECRETS["admin key"]))
            assert reload.status_code == 200 and reload.json()["models"]["tiny"]["changed"] == ["api_key"], reload.text
            assert (
                http.post("/v1/chat/completions", json=chat, headers=auth(SECRETS["yaml client key"])).status_code
                == 200
            )

        # The MLflow wrapper, in URL mode in front of this gateway, with its key from mlflow.api_key_env.
        monkeypatch.setenv("GW_TEST_MLFLOW_KEY", SECRETS["mlflow api_key_env key"])
        model_config = {"models": {"tiny": {"url": server.url}}, "mlflow": {"api_key_env": "GW_TEST_MLFLOW_KEY"}}
        client = EngineClient.from_model_config(
            {**model_config, "mlflow": {**model_config["mlflow"], "defaults": {"max_tokens": 2}}}
        )
        try:
            assert client.chat(HELLO).choices[0].message.role == "assistant"
        finally:
            client.close()
        monkeypatch.setenv("GW_TEST_MLFLOW_KEY", wrong)
        refused = EngineClient.from_model_config(model_config)
        try:
            with pytest.raises(AuthenticationError):
                refused.chat(HELLO)
        finally:
            refused.close()
    finally:
        server.stop()

    text = "\n".join(captured_logs)
    assert '"request_id"' in text and "status=401" in text and "reload (admin)" in text, (
        "the capture missed the gateway's logs"
    )
    leaked = [name for name, secret in SECRETS.items() if secret in text]
    assert not leaked, f"keys found in the logs: {leaked}"
