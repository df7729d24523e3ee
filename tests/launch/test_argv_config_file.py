"""launch.argv without SGLang: the private --config file, the router's flags, the engine's environment (pure).

``tests/launch/test_argv.py`` feeds every argv through SGLang's own parser where SGLang is installed; these
check what the argv builder itself decides, everywhere."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from launch.argv import (
    API_KEY_CONFIG_KEY,
    CONFIG_FLAG,
    CPU_SHIM_DIR,
    EngineFlag,
    Passed,
    _switch,
    _value,
    build_argv,
    build_env,
    flag_values,
    real_sgl_kernel_importable,
    router_args,
    secret_config,
    server_args,
)
from launch.config import EngineConfig, RouterConfig
from launch.engine_net import ENGINE_PLUGIN_DIR


def test_the_flag_tables_helpers() -> None:
    assert _value("--dtype", omit="auto") == EngineFlag(("--dtype",), Passed.VALUE, "auto")
    assert _value("--port") == EngineFlag(("--port",), Passed.VALUE, None)
    assert _switch("--trust-remote-code") == EngineFlag(("--trust-remote-code",), Passed.SWITCH)


def test_the_config_file_replaces_any_config_flag_and_comes_last(tmp_path: Path) -> None:
    engine = EngineConfig(model_path="org/m", extra_args=["--config", "/user.yaml", "--log-level", "info", "--config=/other.yaml"])
    argv = build_argv(engine, port=30001, served_model_name="name", config_file=tmp_path / "secret.yaml")
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert argv[-2:] == [CONFIG_FLAG, str(tmp_path / "secret.yaml")]
    assert argv.count(CONFIG_FLAG) == 1 and not any(arg.startswith("--config=") for arg in argv)
    assert argv[3:-2] == server_args(engine.model_copy(update={"extra_args": ["--log-level", "info"]}), port=30001, served_model_name="name")
    plain = build_argv(engine, port=30001, served_model_name="name")
    assert plain[3:] == server_args(engine, port=30001, served_model_name="name")  # no file: the user's flags as given


def test_a_config_flag_at_the_end_without_a_value_is_dropped_and_read_as_none(tmp_path: Path) -> None:
    engine = EngineConfig(model_path="org/m", extra_args=["--log-level", "info", "--config"])
    argv = build_argv(engine, port=1, config_file="/s.yaml")
    assert argv[-4:] == ["--log-level", "info", CONFIG_FLAG, "/s.yaml"]
    assert secret_config(engine, api_key="k") == {API_KEY_CONFIG_KEY: "k"}


def test_the_secret_config_holds_the_key_and_the_users_own_options(tmp_path: Path) -> None:
    user = tmp_path / "user.yaml"
    user.write_text(yaml.safe_dump({"log-level": "debug", "api-key": "theirs"}))
    for extra in (["--config", str(user)], [f"--config={user}"], ["--log-level", "info", "--config", str(user)]):
        assert secret_config(EngineConfig(model_path="m", extra_args=extra), api_key="ours") == {"log-level": "debug", "api-key": "ours"}
    assert secret_config(EngineConfig(model_path="m"), api_key="ours") == {"api-key": "ours"}
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert secret_config(EngineConfig(model_path="m", extra_args=["--config", str(empty)]), api_key="k") == {"api-key": "k"}
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n")
    with pytest.raises(ValueError) as refused:
        secret_config(EngineConfig(model_path="m", extra_args=["--config", str(listing)]), api_key="k")
    assert str(refused.value) == f"extra_args: --config {listing}: expected a mapping of SGLang options"


def test_a_value_flag_that_only_starts_like_config_is_kept(tmp_path: Path) -> None:
    engine = EngineConfig(model_path="m", extra_args=["--configure", "x", "--config-dir=/d"])
    argv = build_argv(engine, port=1, config_file="/s.yaml")
    assert argv[-5:] == ["--configure", "x", "--config-dir=/d", CONFIG_FLAG, "/s.yaml"]
    assert secret_config(engine, api_key="k") == {"api-key": "k"}


def test_the_router_listens_on_loopback_with_its_workers_and_the_users_flags() -> None:
    router = RouterConfig(policy="round_robin", extra_args=["--log-level", "debug"])
    args = router_args(router, port=7000, metrics_port=7001, worker_urls=["http://127.0.0.1:1", "http://127.0.0.1:2"], tokenizer_path="/tok")
    assert args == [
        "--host", "127.0.0.1", "--port", "7000",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "7001",
        "--policy", "round_robin", "--tokenizer-path", "/tok",
        "--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2",
        "--log-level", "debug",
    ]  # fmt: skip
    bare = router_args(RouterConfig(), port=1, metrics_port=2, worker_urls=[], tokenizer_path="/t")
    assert "--worker-urls" not in bare and bare[-4:] == ["--policy", "cache_aware", "--tokenizer-path", "/t"]


def test_cuda_graph_flags_are_never_spoken_of_on_cpu() -> None:
    engine = EngineConfig(model_path="m", device="cpu", cuda_graph=False)
    assert flag_values(engine, port=1)["cuda_graph"] is None
    assert not any(arg.startswith("--cuda-graph") for arg in server_args(engine, port=1))
    assert flag_values(EngineConfig(model_path="m"), port=1)["cuda_graph"] is True


def test_the_cpu_environment_without_a_pythonpath_and_from_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = EngineConfig(model_path="m", device="cpu")
    env = build_env(cpu, base={})
    assert env.variables["PYTHONPATH"].split(os.pathsep) == [str(ENGINE_PLUGIN_DIR), str(CPU_SHIM_DIR)]
    monkeypatch.setenv("SOME_CALLER_VARIABLE", "kept")
    assert build_env(EngineConfig(model_path="m"), base=None).variables["SOME_CALLER_VARIABLE"] == "kept"
    assert build_env(EngineConfig(model_path="m"), base={}).uses_cpu_shim is False


def _fake_python(tmp_path: Path, body: str) -> str:
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\n{body}\n")
    python.chmod(0o755)
    return str(python)


def test_the_cpu_shim_itself_is_no_real_sgl_kernel(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    python = _fake_python(tmp_path, f'PYTHONPATH={CPU_SHIM_DIR} exec {sys.executable} "$@"')
    assert real_sgl_kernel_importable(python) is False
    broken = _fake_python(tmp_path, 'echo "noise" >&2; exit 3')
    assert real_sgl_kernel_importable(broken) is False
    assert capfd.readouterr() == ("", "")  # the probe's output stays out of the launcher's
    assert real_sgl_kernel_importable(str(tmp_path / "no-such-python")) is False
    assert real_sgl_kernel_importable(sys.executable) is False  # this environment has none (find_spec, no probe)


def test_a_config_path_with_an_equals_sign(tmp_path: Path) -> None:
    user = tmp_path / "a=b.yaml"
    user.write_text("log-level: debug\n")
    engine = EngineConfig(model_path="m", extra_args=[f"--config={user}"])
    assert secret_config(engine, api_key="k") == {"log-level": "debug", "api-key": "k"}


def test_a_real_sgl_kernel_of_this_interpreter_is_probed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # found here (find_spec) ...
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # ... and by the probe
    assert real_sgl_kernel_importable(sys.executable) is True
