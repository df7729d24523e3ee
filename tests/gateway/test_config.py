"""The ``gateway:`` section: defaults, overrides and one-line errors naming file, key and reason."""

from __future__ import annotations

from pathlib import Path
from typing import get_origin

import pytest

from gateway.config import GatewaySettings, gateway_settings, reference_table
from launch.config import (
    GATEWAY_KEY_FILE_SETTINGS,
    GATEWAY_KEY_SETTINGS,
    GATEWAY_PER_MODEL_SETTINGS,
    ConfigError,
    parse_config,
)

REFERENCE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"  # holds the gateway settings reference


def _deployment(gateway: dict) -> object:
    return parse_config({"models": {"a": {"url": "http://127.0.0.1:1"}}, "gateway": gateway}, "deploy.yaml")


def test_the_setting_names_read_outside_the_gateway_package_are_its_own() -> None:
    """``launch.config`` names the key and per-model settings for model_code and the gateway alike: the names
    must be exactly the settings' fields (a new key source or per-model setting left out would go unnoticed)."""
    fields = GatewaySettings.model_fields
    assert set(GATEWAY_KEY_SETTINGS) == {name for name in fields if name.startswith(("api_keys", "admin_keys", "keys"))}
    assert set(GATEWAY_KEY_FILE_SETTINGS) == {name for name in GATEWAY_KEY_SETTINGS if name.endswith("_file")}
    mappings = {name for name, field in fields.items() if get_origin(field.annotation) is dict}
    assert set(GATEWAY_PER_MODEL_SETTINGS) == mappings - {"priority_classes", "residency_groups"}  # the mappings not keyed by model


def test_docs_gateway_reference_is_the_settings_table() -> None:
    """docs/configuration.md's ``gateway:`` table is the settings' own: a setting added, renamed, redescribed or
    given another default in gateway/config.py fails here until the page is regenerated."""
    table = reference_table()
    assert all(f"| `{key}` |" in table for key in ("port", "limits.max_queue", "residency_groups.<name>.turn_s", "keys[].limits.tokens_per_day"))
    assert table in REFERENCE_PAGE.read_text(), (
        "docs/configuration.md's gateway: settings reference differs from gateway/config.py: paste the output of "
        "python -c 'from gateway.config import reference_table as t; print(t())'"
    )


def test_defaults_and_cli_overrides() -> None:
    settings = gateway_settings(_deployment({"port": 9000}), host="0.0.0.0", port=None)
    assert (settings.host, settings.port) == ("0.0.0.0", 9000)
    assert settings.open_paths == ["/health", "/ready"]
    assert settings.limits.max_concurrent is None and settings.resolved_keys() == ()


@pytest.mark.parametrize(
    ("gateway", "message"),
    [
        ({"prot": 1}, "deploy.yaml: gateway.prot: unknown key"),
        ({"port": "x"}, "deploy.yaml: gateway.port: Input should be a valid integer"),
        ({"limits": {"max_concurrent": 0}}, "deploy.yaml: gateway.limits.max_concurrent: Input should be greater than or equal to 1"),
        ({"open_paths": ["/v1/models"]}, "deploy.yaml: gateway.open_paths.0: Input should be '/health', '/ready' or '/metrics'"),
        ({"api_keys": [""]}, "deploy.yaml: gateway.api_keys: API keys must not be empty"),
        ({"model_limits": {"zzz": {}}}, "deploy.yaml: gateway.model_limits.zzz: no model with this name"),
        ({"workers": 0}, "deploy.yaml: gateway.workers: workers must be a number of at least 1, or auto (got 0)"),
        ({"workers": "many"}, "deploy.yaml: gateway.workers: workers must be a number of at least 1, or auto (got 'many')"),
    ],
)
def test_errors_name_file_key_and_reason(gateway: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        gateway_settings(_deployment(gateway))
    assert str(caught.value).startswith(message), str(caught.value)


def test_keys_are_not_printed() -> None:
    settings = gateway_settings(_deployment({"api_keys": ["sekrit-value"]}))
    assert "sekrit-value" not in repr(settings) and "sekrit-value" not in str(settings.model_dump())


def test_a_follower_machine_of_a_multi_machine_engine_is_not_served() -> None:
    engine = {"model_path": "m", "nnodes": 2, "node_rank": 1, "dist_init_addr": "head:5000"}
    deployment = parse_config({"models": {"big": {"engine": engine}}}, "deploy.yaml")
    with pytest.raises(ConfigError) as caught:
        gateway_settings(deployment)
    message = str(caught.value)
    assert message.startswith("deploy.yaml: models.big.engine.node_rank: a machine with node_rank > 0 serves no HTTP")
    assert gateway_settings(parse_config({"models": {"big": {"engine": {**engine, "node_rank": 0}}}}))


@pytest.mark.parametrize(
    ("usage", "models", "message"),
    [
        ({}, None, "deploy.yaml: gateway.replicas.shared needs gateway.usage.database_url: a PostgreSQL URL that every replica reaches"),
        ({"database_url": "sqlite:///u.db"}, None, "deploy.yaml: gateway.replicas.shared needs gateway.usage.database_url"),
        ({"database_url": "postgresql://u@db/ledger"}, {"tiny": {"engine": {"model_path": "m"}}}, "deploy.yaml: models.tiny: replicas sharing one state serve url: or router upstreams"),
        ({"database_url": "postgresql://u@db/ledger", "workers": 2}, None, "deploy.yaml: gateway.workers: a replica sharing a store is one process"),
    ],
)
def test_replicas_without_a_shared_store_are_refused(usage: dict, models: dict | None, message: str) -> None:
    workers = {"workers": usage["workers"]} if "workers" in usage else {}
    usage = {name: value for name, value in usage.items() if name != "workers"}
    gateway = {"replicas": {"shared": True}, "usage": usage, **workers}
    deployment = parse_config({"models": models, "gateway": gateway}, "deploy.yaml") if models else _deployment(gateway)
    with pytest.raises(ConfigError) as caught:
        gateway_settings(deployment)
    assert str(caught.value).startswith(message), str(caught.value)


def test_replicas_with_a_postgresql_store_and_url_models_start() -> None:
    settings = gateway_settings(_deployment({"replicas": {"shared": True, "name": "pod-a"}, "usage": {"database_url": "postgresql://u@db/ledger"}}))
    assert settings.replicas.shared and settings.replicas.name == "pod-a" and settings.replicas.expected == 2
    assert settings.workers == 1  # workers: auto (the default) is one process on a replica
