"""Where an engine's sockets are told to listen: the environment built for one-machine and multi-machine engines
(no engine is started here; ``test_engine_sockets.py`` checks a real one)."""

from __future__ import annotations

import ipaddress
import os

import pytest

from launch.argv import build_env
from launch.config import EngineConfig
from launch.engine_net import (
    ENGINE_PLUGIN_DIR,
    ENGINE_PLUGIN_NAME,
    LOOPBACK_INTERFACE,
    PLUGINS_ENV,
    SOCKET_IFNAME_ENVS,
    dist_init_host,
    interface_addresses,
    interface_holding,
    interface_toward,
    socket_env,
)

GLOO, NCCL = SOCKET_IFNAME_ENVS
SPREAD = dict(model_path="org/m", tp_size=16, nnodes=2, dist_init_addr="10.0.0.1:5000")


def test_one_machine_engine_puts_gloo_and_nccl_on_loopback_and_loads_the_plugin() -> None:
    for device in ("cuda", "cpu"):
        env = build_env(EngineConfig(model_path="org/m", device=device), base={"PYTHONPATH": "/x"}).variables
        assert env[GLOO] == env[NCCL] == LOOPBACK_INTERFACE == "lo"
        parts = env["PYTHONPATH"].split(os.pathsep)
        assert parts[0] == str(ENGINE_PLUGIN_DIR) and parts[-1] == "/x"
        assert PLUGINS_ENV not in env  # unset: SGLang loads every plugin it finds, ours among them


def test_one_machine_engine_overrides_an_inherited_interface_but_not_the_engines_own() -> None:
    inherited = build_env(EngineConfig(model_path="org/m"), base={GLOO: "eth0", NCCL: "^docker"}).variables
    assert inherited[GLOO] == inherited[NCCL] == "lo"  # a cluster-wide default would expose the engine
    chosen = build_env(EngineConfig(model_path="org/m", env={NCCL: "ib0"}), base={NCCL: "eth0"}).variables
    assert chosen[NCCL] == "ib0" and chosen[GLOO] == "lo"  # the YAML's engine.env is a deliberate choice


def test_multi_machine_engine_binds_the_interface_that_reaches_dist_init_addr() -> None:
    asked: list[str] = []

    def finder(host: str) -> str:
        asked.append(host)
        return "eth1"

    for rank in (0, 1):
        env = socket_env(EngineConfig(**SPREAD, node_rank=rank), {}, find_interface=finder)
        assert env[GLOO] == env[NCCL] == "eth1"
        assert env["PYTHONPATH"] == str(ENGINE_PLUGIN_DIR)  # the store binds dist_init_addr's host (the plugin)
    assert asked == ["10.0.0.1", "10.0.0.1"]
    v6 = socket_env(EngineConfig(**{**SPREAD, "dist_init_addr": "[fd00::1]:5000"}), {}, find_interface=finder)
    assert v6[GLOO] == "eth1" and asked[-1] == "fd00::1"


def test_multi_machine_engine_keeps_an_interface_the_environment_names() -> None:
    def finder(host: str) -> str:
        raise AssertionError("no lookup when both are set")

    env = socket_env(EngineConfig(**SPREAD), {GLOO: "bond0", NCCL: "ib0"}, find_interface=finder)
    assert GLOO not in env and NCCL not in env
    partly = socket_env(EngineConfig(**SPREAD), {NCCL: "ib0"}, find_interface=lambda host: "eth1")
    assert partly[GLOO] == "eth1" and NCCL not in partly


def test_multi_machine_engine_with_no_route_leaves_the_choice_to_gloo_and_nccl() -> None:
    env = socket_env(EngineConfig(**SPREAD), {}, find_interface=lambda host: None)
    assert GLOO not in env and NCCL not in env


def test_a_plugin_allow_list_gets_the_gateways_plugin_added() -> None:
    assert socket_env(EngineConfig(model_path="org/m"), {PLUGINS_ENV: "theirs"})[PLUGINS_ENV] == (
        f"theirs,{ENGINE_PLUGIN_NAME}"
    )
    assert PLUGINS_ENV not in socket_env(EngineConfig(model_path="org/m"), {PLUGINS_ENV: ENGINE_PLUGIN_NAME})


def test_plugin_entry_point_is_declared_where_the_engine_path_points() -> None:
    entry_points = next(ENGINE_PLUGIN_DIR.glob("*.dist-info")) / "entry_points.txt"
    text = entry_points.read_text()
    assert "[sglang.srt.plugins]" in text and f"{ENGINE_PLUGIN_NAME} = sglang_gateway_engine_plugin:register" in text


@pytest.mark.parametrize(
    ("addr", "host"), [("10.0.0.1:5000", "10.0.0.1"), ("head-0.workers:5000", "head-0.workers"), ("[fd00::1]:5", "fd00::1")]
)
def test_dist_init_host(addr: str, host: str) -> None:
    assert dist_init_host(addr) == host


def test_interface_lookup_on_this_machine() -> None:
    interfaces = interface_addresses()
    assert ipaddress.ip_address("127.0.0.1") in interfaces[LOOPBACK_INTERFACE]
    assert interface_toward("127.0.0.1") == LOOPBACK_INTERFACE
    assert interface_holding(ipaddress.ip_address("127.0.1.1"), interfaces) == LOOPBACK_INTERFACE  # Debian's hostname
    assert interface_holding(ipaddress.ip_address("203.0.113.9"), interfaces) is None
    assert interface_toward("no-such-host.invalid") is None
    # Rank 0's machine: dist_init_addr is one of its own addresses, reached through the interface holding it.
    for name, addresses in interfaces.items():
        for address in addresses:
            if not address.is_loopback and not address.is_link_local:
                assert interface_toward(str(address)) == name
