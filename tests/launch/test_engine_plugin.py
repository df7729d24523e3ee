"""The SGLang plugin that keeps the engine's torch TCPStore off the network (``launch/engine_plugin``), without an
engine: torch's store factory with and without it, and SGLang finding it on the engine's path; and its hook that
makes the engine act on SIGTERM at once (``prompt_sigterm``), gives a CPU engine's LoRA plain memory
(``cpu_pinned_memory``) and has a CPU engine fork its children (``fork_children``)."""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing
import os
import socket
import subprocess
import sys
from datetime import timedelta
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from launch.argv import CPU_ENGINE_ENV, CPU_LORA_ENV, build_env
from launch.config import EngineConfig
from launch.engine_net import ENGINE_PLUGIN_DIR
from launch.ports import pick_free_port
from launch.proc_sockets import listening_sockets

REPO = ENGINE_PLUGIN_DIR.parent.parent


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ENGINE_PLUGIN_DIR))
    import sglang_gateway_engine_plugin

    return sglang_gateway_engine_plugin


def _store_binds(port: int) -> list[str]:
    return [sock.address for sock in listening_sockets({os.getpid()}) if sock.port == port]


def test_listen_address_is_the_hosts_own_and_a_wildcard_becomes_loopback(plugin: ModuleType) -> None:
    assert plugin.listen_address("127.0.0.1", 5)[1] == ("127.0.0.1", 5)
    assert plugin.listen_address("0.0.0.0", 5) == (socket.AF_INET, ("127.0.0.1", 5))
    assert plugin.listen_address("::", 5)[1][:2] == ("::1", 5)
    assert plugin.listen_address("::1", 5)[0] == socket.AF_INET6


def test_torchs_store_binds_every_interface_and_the_plugins_only_its_host(plugin: ModuleType) -> None:
    original = importlib.import_module("torch.distributed.rendezvous")._create_c10d_store
    timeout = timedelta(seconds=10)
    port = pick_free_port("127.0.0.1")
    store = original("127.0.0.1", port, 0, 1, timeout)
    assert _store_binds(port) in (["::"], ["0.0.0.0"])  # torch's own: the reason for the plugin
    del store
    for host in ("127.0.0.1", "0.0.0.0"):
        port = pick_free_port("127.0.0.1")
        store = plugin.serve_store_on_its_address(original, host, port, 0, 1, timeout)
        assert _store_binds(port) == ["127.0.0.1"]
        client = original(host, port, 1, 2, timeout)  # another rank reaches it at the same address
        client.set("key", "value")
        assert store.get("key") == b"value"
        del client, store


def test_other_ranks_and_a_taken_port_are_left_to_torch(plugin: ModuleType) -> None:
    calls: list[tuple[Any, ...]] = []

    def original(*args: Any) -> str:
        calls.append(args)
        return "torch's"

    timeout = timedelta(seconds=1)
    assert plugin.serve_store_on_its_address(original, "127.0.0.1", 1234, 1, 2, timeout) == "torch's"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert plugin.serve_store_on_its_address(original, "127.0.0.1", port, 0, 2, timeout, False) == "torch's"
    assert calls == [("127.0.0.1", 1234, 1, 2, timeout, True), ("127.0.0.1", port, 0, 2, timeout, False)]


PROBE = """
import os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.managers.tokenizer_manager import TokenizerManager
print("sigterm watchdog hooked:", hasattr(TokenizerManager.sigterm_watchdog, "__wrapped__"))
from sglang.srt.entrypoints import engine
print("start method hooked:", hasattr(engine._set_envs_and_config, "__wrapped__"))
import torch.distributed as dist
from launch.proc_sockets import listening_sockets
port = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
print(sorted({(s.address, s.port == port) for s in listening_sockets({os.getpid()})}))
dist.destroy_process_group()
"""


def test_sglang_loads_the_plugin_from_the_engine_path_and_rendezvous_stays_on_loopback() -> None:
    """What SGLang's scheduler does at start (load_plugins, then torch's tcp:// rendezvous and gloo)."""
    cpu_engine = build_env(EngineConfig(model_path="/m", device="cpu")).variables  # fork_children hooks only then
    path = [str(ENGINE_PLUGIN_DIR), str(REPO), cpu_engine.get("PYTHONPATH", "")]  # and the sgl_kernel stand-in
    env = {**cpu_engine, "PYTHONPATH": os.pathsep.join(filter(None, path)), "GLOO_SOCKET_IFNAME": "lo"}
    assert env[CPU_ENGINE_ENV] == "1"
    port = pick_free_port("127.0.0.1")
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(port)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    *_, hooked, fork_hooked, found = probe.stdout.strip().splitlines()
    print("listening:", found)
    assert found == "[('127.0.0.1', False), ('127.0.0.1', True)]", (found, probe.stderr[-3000:])
    assert hooked == "sigterm watchdog hooked: True"  # the same entry point: prompt_sigterm
    assert fork_hooked == "start method hooked: True"  # and fork_children, on a CPU engine


def test_a_cpu_engine_forks_its_children_unless_it_opts_out_and_a_gpu_engine_spawns(plugin: ModuleType) -> None:
    """Spawn re-imports sglang and torch in each child (two thirds of a CPU engine's start-up CPU); CUDA needs it."""
    from sglang_gateway_engine_plugin import fork_children

    cpu_env = build_env(EngineConfig(model_path="/m", device="cpu"), base={}).variables
    assert fork_children.wanted(cpu_env)
    assert not fork_children.wanted({**cpu_env, fork_children.OPT_OUT_ENV: "0"})
    assert not fork_children.wanted(build_env(EngineConfig(model_path="/m", device="cuda"), base={}).variables)
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        multiprocessing.set_start_method("spawn", force=True)  # what SGLang's _set_envs_and_config chose
        assert fork_children.fork_after_config("its result", "server_args") == "its result"
        assert multiprocessing.get_start_method() == "fork"
    finally:
        multiprocessing.set_start_method(before, force=True)


def test_the_sigterm_watchdog_runs_sglangs_own_once_the_flag_is_set(plugin: ModuleType) -> None:
    """SGLang's watchdog (drain, ShutdownReq, exit) runs only after its SIGTERM flag is set, as before, and then
    finds the flag set: the hook only watches the flag more often than SGLang's 5-second sleep."""
    from sglang_gateway_engine_plugin import prompt_sigterm

    manager = SimpleNamespace(gracefully_exit=False)
    ran: list[tuple[Any, bool]] = []

    async def original(target: Any) -> str:
        ran.append((target, target.gracefully_exit))
        return "shut down"

    async def scenario() -> str:
        watchdog = asyncio.ensure_future(prompt_sigterm.watch_sigterm_promptly(original, manager))
        await asyncio.sleep(3 * prompt_sigterm.POLL_S)
        assert not ran and not watchdog.done()  # no SIGTERM yet: SGLang's watchdog has not started
        manager.gracefully_exit = True  # what SGLang's SIGTERM handler does
        return await asyncio.wait_for(watchdog, 30)

    assert asyncio.run(scenario()) == "shut down"
    assert ran == [(manager, True)]


PINNED_PROBE = """
import torch
from sglang_gateway_engine_plugin import cpu_pinned_memory
cpu_pinned_memory.register()
try:
    pinned = torch.tensor([1, 2], dtype=torch.int32, pin_memory=True)
    print("tensor", pinned.tolist(), pinned.is_pinned(), torch.zeros(2).pin_memory().tolist())
except RuntimeError as error:
    print("refused", str(error).splitlines()[0])
"""


@pytest.mark.parametrize(("cpu_engine", "expected"), [("1", "tensor [1, 2] False [0.0, 0.0]"), ("", "refused")])
def test_pinned_memory_is_plain_memory_on_a_cpu_lora_engine_only(cpu_engine: str, expected: str) -> None:
    """SGLang's LoRA layers ask for pinned tensors, which torch refuses without a GPU; a CPU engine with LoRA (the
    launcher sets the variable for it, below) gets plain ones."""
    env = {**os.environ, "PYTHONPATH": str(ENGINE_PLUGIN_DIR), CPU_LORA_ENV: cpu_engine}
    probe = subprocess.run([sys.executable, "-c", PINNED_PROBE], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().startswith(expected), probe.stdout


def test_the_launcher_asks_for_plain_memory_only_for_a_cpu_engine_with_lora() -> None:
    env = lambda **keys: build_env(EngineConfig(model_path="/m", **keys), base={}).variables  # noqa: E731
    assert env(device="cpu", enable_lora=True)[CPU_LORA_ENV] == "1"
    assert CPU_LORA_ENV not in env(device="cpu") and CPU_LORA_ENV not in env(enable_lora=True)
