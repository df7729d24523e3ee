"""The SGLang plugin that keeps the engine's torch TCPStore off the network (``launch/engine_plugin``), without an
engine: torch's store factory with and without it, and SGLang finding it on the engine's path; and its hook that
makes the engine act on SIGTERM at once (``prompt_sigterm``), gives a CPU engine's LoRA plain memory
(``cpu_pinned_memory``) and has a CPU engine fork its children (``fork_children``)."""

from __future__ import annotations

import asyncio
import importlib
import json
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
from tests.conftest import DEFAULT_MODEL

REPO = ENGINE_PLUGIN_DIR.parent.parent


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ENGINE_PLUGIN_DIR))
    import sglang_gateway_engine_plugin

    return sglang_gateway_engine_plugin


def call_markers(structural_tag: str) -> Any:
    from sglang_gateway_engine_plugin.parallel_calls_end import call_markers as markers

    return markers(structural_tag)


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
from tests.conftest import DEFAULT_MODEL
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


def _forced_constraints(parser_name: str) -> dict[str, Any] | None:
    """SGLang's constraint for each forced choice with parser ``parser_name``, through the plugin's hook: {choice: the
    constraint's (kind, JSON form)}; None where the parser cannot be built without a model."""
    from sglang.srt.entrypoints.openai.protocol import Tool, ToolChoice
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang_gateway_engine_plugin.forced_calls_end import end_forced_calls

    tools = [Tool(type="function", function={"name": "f", "parameters": CALL_SCHEMA, "strict": True})]
    try:
        parser = FunctionCallParser(tools, parser_name)
    except Exception:  # noqa: BLE001 - a template parser needs its model's tokenizer
        return None
    found = {}
    for choice, parallel in (("named", True), ("required_one", False), ("required", True)):
        tool_choice: Any = ToolChoice(type="function", function={"name": "f"}) if choice == "named" else "required"
        constraint = end_forced_calls(FunctionCallParser.get_structure_constraint, parser, tool_choice, parallel_tool_calls=parallel)
        kind, value = constraint or (None, None)  # None: SGLang could build none for this format (it logs why)
        found[choice] = (kind, value.model_dump(by_alias=True) if hasattr(value, "model_dump") else value)
    return found


CALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def _accepts(tag: dict[str, Any], text: str) -> bool:
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(Grammar.from_structural_tag(json.dumps(tag)), text)


@pytest.mark.parametrize("parser_name", ["qwen25", "hermes", "llama3", "mistral", "interns1", "deepseekv3"])
def test_a_forced_calls_grammar_ends_after_the_calls_in_the_parsers_own_format(plugin: ModuleType, parser_name: str) -> None:
    """SGLang's grammar let the model write on after a forced call (to max_tokens, the answer cut short); the plugin's
    ends a call that must come alone (named, or required with parallel calls off) right after it (a newline allowed,
    as models write one), in SGLang's own detector's tags (begin, schema, end). Parallel calls keep SGLang's grammar,
    marked for the scheduler's hook."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    info = FunctionCallParser.ToolCallParserEnum[parser_name]().structure_info()("f")
    one = info.begin + '{"a": "x"}' + info.end
    found = _forced_constraints(parser_name)
    assert found is not None
    for choice in ("named", "required_one"):
        kind, tag = found[choice]
        assert kind == "structural_tag", (choice, kind)
        assert _accepts(tag, one) and _accepts(tag, one + "\n"), (choice, tag)
        assert not _accepts(tag, one + " and more text") and not _accepts(tag, one + "\n\n"), (choice, tag)
        assert not _accepts(tag, one + "\n" + one) and not _accepts(tag, "text first " + one), choice
    kind, tag = found["required"]  # parallel calls: SGLang's grammar, in the form the scheduler's hook recognises
    markers = call_markers(json.dumps(tag))
    assert kind == "structural_tag" and markers is not None, tag
    assert any(one.endswith(end) for end in markers.ends) and any(one.startswith(t) for t in markers.triggers), markers
    assert _accepts(tag, one + "\n" + one) and _accepts(tag, one + " and more text"), tag  # the scheduler ends the text


def test_sglangs_own_forced_grammar_lets_the_model_write_on_after_the_call() -> None:
    """Why the hook exists (SGLang 0.5.23, without it): text after a complete forced call is in the grammar."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from xgrammar import StructuralTag, StructuralTagItem

    tools = [Tool(type="function", function={"name": "f", "parameters": CALL_SCHEMA, "strict": True})]
    kind, legacy = FunctionCallParser(tools, "qwen25").get_structure_constraint("required", parallel_tool_calls=False)
    structures = legacy.model_dump(by_alias=True)["structures"]
    tag = StructuralTag.from_legacy_structural_tag(
        [StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]) for s in structures], legacy.triggers
    )
    tag.format.at_least_one = True  # as SGLang's grammar backend compiles it
    one = structures[0]["begin"] + '{"a": "x"}' + structures[0]["end"]
    assert kind == "structural_tag" and _accepts(tag.model_dump(by_alias=True), one + " and more text")


def _format_types(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*(_format_types(item) for item in node))
    if not isinstance(node, dict):
        return set()
    return ({node["type"]} if isinstance(node.get("type"), str) else set()).union(*(_format_types(v) for v in node.values()))


def test_every_shipped_parsers_forced_grammar_leaves_no_free_text_after_a_lone_call(plugin: ModuleType) -> None:
    """For every tool-call parser SGLang ships (any may be set as engine.tool_call_parser): a lone forced call's
    constraint holds no triggered tags (free text after a call) once the plugin has it: the plugin's own form, a
    built-in tag that ends after the calls, or a JSON schema / whole-turn grammar (ending with its value); or none,
    where SGLang builds none for the format (muse, spark25, hunyuan: SGLang logs why). Parallel calls whose grammar
    allows free text after them are marked for the scheduler's hook, which ends the turn there."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    unbuilt = []
    for name in FunctionCallParser.ToolCallParserEnum:
        found = _forced_constraints(name)
        if found is None:
            unbuilt.append(name)
            continue
        for choice, (kind, value) in found.items():
            if choice == "required":  # parallel calls: SGLang's grammar, free text after the calls ended by the scheduler
                free_text = kind == "structural_tag" and ("structures" in value or "triggered_tags" in _format_types(value))
                assert not free_text or call_markers(json.dumps(value)) is not None, (name, value)
                continue
            assert kind in ("structural_tag", "json_schema", "full_assistant_ebnf", "ebnf", None), (name, choice, kind)
            if kind == "structural_tag":
                assert "structures" not in value and "triggered_tags" not in _format_types(value), (name, choice, value)
    assert unbuilt == ["response_template"], unbuilt  # needs its model's own chat template


@pytest.mark.parametrize(
    ("after", "kept"),
    [
        ("\nThe weather in Lima is", "\n"),  # prose: cut before it, the newline kept
        ("The answer", ""),
        ("\n<b>bold</b>", "\n"),  # a '<' that starts no call
        ("\n\n", None),  # whitespace: maybe another call to come
        ("\n<tool", None),  # a call starting
        ('\n<tool_call>\n{"name":"f", "arguments":{"a": "y', None),  # another call under way
    ],
)
def test_the_scheduler_ends_forced_parallel_calls_where_text_that_is_no_call_begins(
    plugin: ModuleType, after: str, kept: str | None
) -> None:
    """``cut_before_text`` on the default model's own tokens: the tokens to keep (the calls and the whitespace after
    them) once the text after the last call is neither whitespace nor the start of another call; None before."""
    from sglang_gateway_engine_plugin.parallel_calls_end import CallMarkers, cut_before_text
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    call = '<tool_call>\n{"name":"f", "arguments":{"a": "x"}}\n</tool_call>'
    markers = CallMarkers(ends=("}\n</tool_call>",), triggers=("<tool_call>",))
    ids = tokenizer.encode(call + after)
    keep = cut_before_text(ids, tokenizer.decode, markers)
    if kept is None:
        assert keep is None, tokenizer.decode(ids[:keep])
    else:
        assert keep is not None and tokenizer.decode(ids[:keep]) == call + kept, keep


def test_only_the_plugins_marked_form_is_ended_by_the_scheduler(plugin: ModuleType) -> None:
    """A structural tag a client sends (triggered tags, at least one) is not the plugin's form: the scheduler's hook
    leaves it alone; the marked form gives the tags' end markers and triggers."""
    from sglang_gateway_engine_plugin.parallel_calls_end import CallMarkers, marked_parallel_tag

    form = {"type": "triggered_tags", "triggers": ["<t>"], "at_least_one": True, "stop_after_first": False,
            "tags": [{"type": "tag", "begin": "<t>", "content": {"type": "any_text"}, "end": "</t>"}]}  # fmt: skip
    assert call_markers(json.dumps({"type": "structural_tag", "format": form})) is None
    marked = marked_parallel_tag({"type": "structural_tag", "format": form})
    assert call_markers(json.dumps(marked)) == CallMarkers(ends=("</t>",), triggers=("<t>",))
    assert (
        marked_parallel_tag({"type": "structural_tag", "format": {**form, "at_least_one": False}}) is None
    )  # not forced
    assert (
        marked_parallel_tag({"type": "structural_tag", "format": {**form, "stop_after_first": True}}) is None
    )  # one call
