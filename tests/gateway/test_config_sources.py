"""The ``gateway:`` section's keys from the YAML, variables and files, its paths, and its default state
directory (gateway.config; pure: temporary files and variables only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine_guard.fields import EXTENSIONS
from gateway.config import BalancingSettings, GatewaySettings, default_state_dir, gateway_settings
from launch.config import ConfigError, parse_config

MODELS = {"a": {"url": "http://127.0.0.1:1"}, "b": {"url": "http://127.0.0.1:2"}}


def _settings(gateway: dict, source: str | Path | None = "deploy.yaml") -> GatewaySettings:
    deployment = parse_config({"models": MODELS, "gateway": gateway}, source) if source else parse_config({"models": MODELS, "gateway": gateway})
    return gateway_settings(deployment)


def _refusal(gateway: dict, source: str | Path | None = "deploy.yaml") -> str:
    with pytest.raises(ConfigError) as refused:
        _settings(gateway, source)
    return str(refused.value)


def test_client_keys_from_the_yaml_a_variable_and_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_KEYS", " env-1 ,, env-2,yaml-1 ,")
    keys = tmp_path / "keys"
    keys.write_text("# a comment\n\nfile-1\n   # an indented comment\n  file-2  \nenv-1\n")
    settings = _settings({"api_keys": [" yaml-1 "], "api_keys_env": "GW_KEYS", "api_keys_file": str(keys)})
    # in order (YAML, variable, file), stripped, each once, as bytes
    assert settings.resolved_keys() == (b"yaml-1", b"env-1", b"env-2", b"file-1", b"file-2")
    assert settings.resolved_admin_keys() == ()


def test_admin_keys_from_their_own_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_ADMIN", "admin-env")
    keys = tmp_path / "admin"
    keys.write_text("admin-file\n")
    settings = _settings({"api_keys": ["client"], "admin_keys": ["admin-yaml"], "admin_keys_env": "GW_ADMIN", "admin_keys_file": str(keys)})
    assert settings.resolved_admin_keys() == (b"admin-yaml", b"admin-env", b"admin-file")
    assert settings.resolved_keys() == (b"client",)


def test_a_missing_variable_is_named_with_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GW_UNSET", raising=False)
    assert _refusal({"api_keys_env": "GW_UNSET"}) == "deploy.yaml: gateway.api_keys_env: environment variable GW_UNSET is not set"
    assert _refusal({"admin_keys_env": "GW_UNSET"}) == "deploy.yaml: gateway.admin_keys_env: environment variable GW_UNSET is not set"
    settings = GatewaySettings(api_keys_env="GW_UNSET", admin_keys_env="GW_UNSET")
    with pytest.raises(ConfigError, match="^config: gateway.api_keys_env: "):  # asked without a file name
        settings.resolved_keys()
    with pytest.raises(ConfigError, match="^config: gateway.admin_keys_env: "):
        settings.resolved_admin_keys()
    with pytest.raises(ConfigError, match="^serve: gateway.api_keys_env: "):
        settings.resolved_keys("serve")


def test_an_empty_variable_gives_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_EMPTY", "")
    assert _settings({"api_keys_env": "GW_EMPTY"}).resolved_keys() == ()


def test_key_files_that_cannot_be_read_or_hold_no_key(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    assert _refusal({"api_keys_file": str(missing)}) == (
        f"deploy.yaml: gateway.api_keys_file: cannot read {missing}: No such file or directory"
    )
    assert _refusal({"admin_keys_file": str(missing)}).startswith("deploy.yaml: gateway.admin_keys_file: cannot read")
    empty = tmp_path / "empty"
    empty.write_text("# only a comment\n\n")
    assert _refusal({"api_keys_file": str(empty)}) == f"deploy.yaml: gateway.api_keys_file: {empty} holds no key"
    # a file of comments next to keys from elsewhere is no error: the keys are the others
    assert _settings({"api_keys": ["k"], "api_keys_file": str(empty)}).resolved_keys() == (b"k",)


def test_an_admin_key_is_never_a_client_key(tmp_path: Path) -> None:
    message = _refusal({"api_keys": ["shared", "client"], "admin_keys": ["shared"]})
    assert message == "deploy.yaml: gateway.admin_keys: an admin key must not also be a client key"
    keys = tmp_path / "keys"
    keys.write_text("from-file\n")
    assert _refusal({"api_keys_file": str(keys), "admin_keys": ["from-file"]}).endswith("must not also be a client key")
    assert _settings({"api_keys": ["client"], "admin_keys": ["admin"]}).resolved_admin_keys() == (b"admin",)


def test_key_files_and_the_state_dir_are_relative_to_the_deployment_file(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("k1\n")
    (tmp_path / "admin").write_text("a1\n")
    settings = _settings({"api_keys_file": "keys", "admin_keys_file": "admin", "state_dir": "state"}, tmp_path / "deploy.yaml")
    assert settings.api_keys_file == tmp_path / "keys" and settings.admin_keys_file == tmp_path / "admin"
    assert settings.state_dir == tmp_path / "state"
    assert settings.resolved_keys() == (b"k1",)
    absolute = tmp_path / "elsewhere"
    assert _settings({"state_dir": str(absolute)}, tmp_path / "deploy.yaml").state_dir == absolute


def test_the_state_dir_defaults_to_the_deployments_own(tmp_path: Path) -> None:
    source = tmp_path / "deploy.yaml"
    assert _settings({}, source).state_dir == default_state_dir(source)
    assert _settings({}, None).state_dir is None  # built in memory: no file, no state kept


def test_errors_are_prefixed_once_per_line() -> None:
    message = _refusal({"port": "x", "drain_timeout_s": -1})
    lines = message.splitlines()
    assert len(lines) == 2
    assert sorted(line.split(": ")[1] for line in lines) == ["gateway.drain_timeout_s", "gateway.port"]
    assert all(line.startswith("deploy.yaml: gateway.") for line in lines)
    # a key that repeats the file name is left as it is: only each line's own leading name gets "gateway."
    (line,) = _refusal({"model_limits": {"deploy.yaml: x": {"max_queue": -1}}}).splitlines()
    assert line.startswith("deploy.yaml: gateway.model_limits.deploy.yaml: x.max_queue: ")
    assert _refusal({"port": "x"}, None).startswith("config: gateway.port: ")


def test_extension_fields_must_be_known_ones() -> None:
    known = sorted(EXTENSIONS)[0]
    assert _settings({"extension_fields": {"a": [known]}}).extensions_for("a") == frozenset({known})
    message = _refusal({"extension_fields": {"a": [known, "made_up"]}})
    assert message == "deploy.yaml: gateway.extension_fields.a: 'made_up' is not an SGLang extension field the gateway knows"


def test_per_model_overrides_and_their_defaults() -> None:
    settings = _settings({"model_balancing": {"b": {"policy": "prefix_affinity"}}, "balancing": {"max_imbalance": 9}, "extension_fields": {"b": []}})
    assert settings.balancing_for("b") == BalancingSettings(policy="prefix_affinity")
    assert settings.balancing_for("a") == BalancingSettings(max_imbalance=9)
    assert settings.extensions_for("a") == frozenset() and settings.extensions_for("b") == frozenset()


def test_the_default_state_dir_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    here = default_state_dir(tmp_path / "My Deploy!.yaml")
    assert here.parent == tmp_path / "xdg" / "sglang-gateway"
    name, _, digest = here.name.rpartition("-")
    assert name == "My_Deploy_" and digest  # runs of other characters become one "_"
    assert default_state_dir(tmp_path / "prod-eu.v2.yaml").name.startswith("prod-eu.v2-")
    assert default_state_dir(tmp_path / f"{'x' * 60}.yaml").name.rpartition("-")[0] == "x" * 40
    assert default_state_dir(tmp_path / "!!!.yaml").name.startswith("_-")
    assert default_state_dir(tmp_path / ".yaml").name.startswith(".yaml-")
    assert default_state_dir("").name.startswith("deployment-")  # no name at all


def test_the_default_state_dir_is_one_per_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        (tmp_path / folder / "deploy.yaml").write_text("models: {}\n")
    first, second = default_state_dir(tmp_path / "a" / "deploy.yaml"), default_state_dir(tmp_path / "b" / "deploy.yaml")
    assert first != second and first.name.startswith("deploy-") and second.name.startswith("deploy-")
    monkeypatch.chdir(tmp_path / "a")
    assert default_state_dir("deploy.yaml") == first  # the same file, however it is named
    assert default_state_dir(Path("../b/deploy.yaml")) == second
    # a model URI is not a file: named as it is, wherever the gateway runs
    uri = default_state_dir("models:/chat/3")
    monkeypatch.chdir(tmp_path / "b")
    assert default_state_dir("models:/chat/3") == uri and default_state_dir("models:/other/3") != uri


def test_the_default_state_dir_without_xdg_state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_state_dir("d.yaml").parent == tmp_path / ".local" / "state" / "sglang-gateway"
    monkeypatch.setenv("XDG_STATE_HOME", "")  # empty counts as unset
    assert default_state_dir("d.yaml").parent == tmp_path / ".local" / "state" / "sglang-gateway"
    assert os.environ["XDG_STATE_HOME"] == ""


def test_a_follower_machine_is_told_how_to_start() -> None:
    engine = {"model_path": "m", "nnodes": 2, "node_rank": 1, "dist_init_addr": "head:5000"}
    with pytest.raises(ConfigError) as refused:
        gateway_settings(parse_config({"models": {"big": {"engine": engine}}}, "d.yaml"))
    assert str(refused.value) == (
        "d.yaml: models.big.engine.node_rank: a machine with node_rank > 0 serves no HTTP; "
        "start it with `sglang-gateway launch` and serve the engine from the machine with node_rank 0"
    )
