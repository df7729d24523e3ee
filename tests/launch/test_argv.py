"""The argv builder: flag mapping, CPU defaults, and every argv checked by SGLang's own parser.

The flag table (``launch.argv.ENGINE_FLAGS``) drives the checks: SGLang's parser reads back the destination of
every flag, each key's value must land where the table says, every key must be exercised by a variant below,
and every key of ``EngineConfig`` is either in the table or named as not a flag.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch.argv import (
    CPU_ENGINE_ENV,
    CPU_SHIM_DIR,
    ENGINE_FLAGS,
    NOT_FLAGS,
    Passed,
    build_argv,
    build_env,
    engine_reference_table,
    flag_values,
    secret_config,
    server_args,
)
from launch.config import CPU_DEFAULT_MAX_TOTAL_TOKENS, EngineConfig, load_config
from launch.engine_net import ENGINE_PLUGIN_DIR
from launch.preflight import preflight, require
from launch.process import new_engine_key

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENGINE_REFERENCE_PAGE = REPO / "docs" / "configuration.md"  # holds the engine section reference
PORT = 30123
# What SGLang's parser is asked to read back: every flag's destination, and two set through --config files.
PARSED_FIELDS = sorted({dest for flag in ENGINE_FLAGS.values() for dest in flag.dests} | {"api_key", "log_level"})


def flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_minimal_gpu_argv() -> None:
    args = server_args(EngineConfig(model_path="org/m"), port=31000, served_model_name="m")
    assert args[:2] == ["--model-path", "org/m"]
    assert flag_value(args, "--port") == "31000"
    assert flag_value(args, "--served-model-name") == "m"
    assert "--dtype" not in args  # "auto" is SGLang's default: not spelled out
    assert "--cuda-graph-backend-decode" not in args  # graphs on by default on cuda
    assert "--enable-metrics" in args


def test_cuda_graph_off_disables_both_phases() -> None:
    args = server_args(EngineConfig(model_path="org/m", cuda_graph=False), port=1)
    assert flag_value(args, "--cuda-graph-backend-decode") == "disabled"
    assert flag_value(args, "--cuda-graph-backend-prefill") == "disabled"


def test_cuda_graph_on_with_max_bs() -> None:
    args = server_args(EngineConfig(model_path="org/m", cuda_graph=True, cuda_graph_max_bs=48), port=1)
    assert flag_value(args, "--cuda-graph-max-bs-decode") == "48"
    assert "disabled" not in args


def test_cpu_defaults_and_explicit_overrides() -> None:
    args = server_args(EngineConfig(model_path="org/m", device="cpu"), port=1)
    assert flag_value(args, "--device") == "cpu"
    assert flag_value(args, "--attention-backend") == "torch_native"
    assert flag_value(args, "--max-total-tokens") == str(CPU_DEFAULT_MAX_TOTAL_TOKENS)
    assert "--sleep-on-idle" in args
    assert "--cuda-graph-backend-decode" not in args  # no CUDA on a CPU engine
    custom = server_args(
        EngineConfig(model_path="org/m", device="cpu", max_total_tokens=1024, sleep_on_idle=False), port=1
    )
    assert flag_value(custom, "--max-total-tokens") == "1024" and "--sleep-on-idle" not in custom


def test_served_name_from_config_wins_and_extra_args_come_last() -> None:
    engine = EngineConfig(model_path="org/m", served_model_name="public", extra_args=["--log-level", "warning"])
    args = server_args(engine, port=1, served_model_name="key")
    assert flag_value(args, "--served-model-name") == "public"
    assert args[-2:] == ["--log-level", "warning"]


def test_build_argv_uses_the_configured_python() -> None:
    assert build_argv(EngineConfig(model_path="org/m"), port=1)[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert build_argv(EngineConfig(model_path="org/m", python="/opt/py/bin/python"), port=1)[0] == "/opt/py/bin/python"


def test_cpu_env_adds_engine_flag_and_shim_only_for_the_engine() -> None:
    env = build_env(
        EngineConfig(model_path="org/m", device="cpu", env={"OMP_NUM_THREADS": "2"}), base={"PYTHONPATH": "/x"}
    )
    assert env.variables[CPU_ENGINE_ENV] == "1"
    assert env.uses_cpu_shim  # this environment has no real sgl_kernel
    assert env.variables["PYTHONPATH"].split(":") == [str(ENGINE_PLUGIN_DIR), str(CPU_SHIM_DIR), "/x"]
    assert env.variables["OMP_NUM_THREADS"] == "2"
    gpu = build_env(EngineConfig(model_path="org/m"), base={})
    assert CPU_ENGINE_ENV not in gpu.variables and not gpu.uses_cpu_shim
    assert gpu.variables["PYTHONPATH"] == str(ENGINE_PLUGIN_DIR)  # the SGLang plugin only (see test_engine_net.py)


def test_cpu_shim_stays_off_when_a_real_sgl_kernel_imports(tmp_path: Path) -> None:
    real = tmp_path / "site" / "sgl_kernel"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("")
    fake_python = tmp_path / "python"
    fake_python.write_text(f'#!/bin/sh\nPYTHONPATH={real.parent} exec {sys.executable} "$@"\n')
    fake_python.chmod(0o755)
    env = build_env(EngineConfig(model_path="org/m", device="cpu", python=str(fake_python)), base={})
    assert not env.uses_cpu_shim and env.variables["PYTHONPATH"] == str(ENGINE_PLUGIN_DIR)


# An engine with every key set away from its default (a new key of ENGINE_FLAGS gets its value here).
FULL = dict(
    model_path="org/m",
    tokenizer_path="org/tok",
    served_model_name="served",
    host="0.0.0.0",
    tp_size=2,
    dp_size=2,
    nnodes=2,
    node_rank=1,
    dist_init_addr="10.0.0.1:5000",
    mem_fraction_static=0.8,
    max_total_tokens=10000,
    context_length=8192,
    max_running_requests=64,
    dtype="bfloat16",
    quantization="fp8",
    chunked_prefill_size=4096,
    grammar_backend="xgrammar",
    tool_call_parser="qwen25",
    reasoning_parser="deepseek-r1",
    chat_template="chatml",
    attention_backend="triton",
    random_seed=7,
    trust_remote_code=True,
    json_disable_any_whitespace=True,
    skip_server_warmup=True,
    sleep_on_idle=True,
    enable_response_store=True,
    enable_priority_scheduling=True,
    enable_memory_saver=True,
    enable_weights_cpu_backup=True,
    enable_trace=True,
    otlp_traces_endpoint="collector:4317",
    otlp_traces_protocol="grpc",
    otlp_service_name="sglang-served",
    enable_lora=True,
    lora_paths={"a1": "/adapters/a1", "a2": "/adapters/a2"},
    max_lora_rank=16,
    lora_target_modules=["q_proj", "v_proj"],
    max_loras_per_batch=4,
    max_loaded_loras=8,
    lora_eviction_policy="fifo",
    lora_backend="triton",
)
MISSPELLED = ["--model-path", "org/m", "--disable-cuda-graphs"]
VARIANTS: dict[str, EngineConfig] = {
    "minimal-gpu": EngineConfig(model_path="org/m"),
    "full-gpu-graphs-on": EngineConfig(**FULL, cuda_graph=True, cuda_graph_max_bs=32),
    "full-gpu-graphs-off": EngineConfig(**FULL, cuda_graph=False),
    "cpu-defaults": EngineConfig(model_path="org/m", device="cpu", dtype="float32"),
    "cpu-chunking-off": EngineConfig(model_path="org/m", device="cpu", chunked_prefill_size=-1, enable_metrics=False),
    "extra-args": EngineConfig(model_path="org/m", extra_args=["--log-level", "warning"]),
}


def keyed_argv(directory: Path) -> list[str]:
    """An engine with an API key, and a user's own ``--config`` file in extra_args (merged into ours)."""
    user = directory / "user.yaml"
    user.write_text("log-level: warning\n")
    engine = EngineConfig(model_path="org/m", extra_args=["--config", str(user)])
    secret = directory / "secret.yaml"
    secret.write_text(yaml.safe_dump(secret_config(engine, api_key="k-123")))
    argv = build_argv(engine, port=30123, served_model_name="key", config_file=secret)[3:]
    assert argv.count("--config") == 1 and str(user) not in argv
    return argv


# The shipped GPU deployments (configs/*.yaml with a cuda engine), as a GPU machine with a CUDA
# toolkit would launch them: through the preflight, on as many GPUs as they ask for.
PRESETS: dict[str, tuple[str, EngineConfig]] = {
    f"{path.stem}:{name}": (name, engine)
    for path in sorted((REPO / "configs").glob("*.yaml"))
    for name, engine in load_config(path).managed().items()
    if engine.device == "cuda"
}


def launched_preset(preset: str) -> EngineConfig:
    name, engine = PRESETS[preset]
    gpus = engine.tp_size * engine.dp_size
    return require(preflight(engine, gpu_count=gpus, cuda_home="/usr/local/cuda", driver_cuda=(13, 0)), name)


def test_there_are_gpu_presets() -> None:
    assert len(PRESETS) >= 2, PRESETS


@pytest.fixture(scope="module")
def sglang_parsed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every variant's and preset's argv parsed by ``sglang.srt.server_args.prepare_server_args`` (one subprocess)."""
    pytest.importorskip("sglang")
    argvs = [server_args(engine, port=PORT, served_model_name="key") for engine in VARIANTS.values()]
    argvs.append(keyed_argv(tmp_path_factory.mktemp("engine-key")))
    argvs += [server_args(launched_preset(preset), port=8001, served_model_name=PRESETS[preset][0]) for preset in PRESETS]
    argvs.append(MISSPELLED)
    proc = subprocess.run(
        [sys.executable, str(HERE / "sglang_parse_argv.py")],
        input=json.dumps({"fields": PARSED_FIELDS, "argvs": argvs}),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line, f"parser script failed:\n{proc.stderr[-3000:]}"
    return dict(zip([*VARIANTS, "engine-key", *PRESETS, "misspelled"], json.loads(line.removeprefix("RESULTS ")), strict=True))


def test_the_engine_key_reaches_sglang_through_the_config_file(sglang_parsed: dict[str, dict]) -> None:
    result = sglang_parsed["engine-key"]
    assert result["ok"], result.get("error")
    assert result["args"]["api_key"] == "k-123"
    assert result["args"]["log_level"] == "warning"  # the user's own --config file still applies


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sglang_accepts_every_argv(sglang_parsed: dict[str, dict], variant: str) -> None:
    result = sglang_parsed[variant]
    assert result["ok"], f"SGLang rejected the argv for {variant}: {result.get('error')}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sglang_reads_each_value_where_the_table_says(sglang_parsed: dict[str, dict], variant: str) -> None:
    """Every flag the argv carries lands in SGLang's ``ServerArgs`` with the key's value."""
    parsed = sglang_parsed[variant]["args"]
    values = flag_values(VARIANTS[variant], port=PORT, served_model_name="key")
    for key, flag in ENGINE_FLAGS.items():
        if not flag.argv(values[key]):
            continue  # not passed: SGLang's own default applies
        for dest in flag.dests:
            got = parsed[dest]
            if flag.passed is Passed.SWITCH:
                assert got is True, (key, dest, got)
            elif flag.passed is Passed.OFF:
                assert "disabled" in str(got), (key, dest, got)
            elif flag.passed is Passed.LIST:  # each item, a mapping's as name=value
                assert [str(item) for item in got] == flag.argv(values[key])[1:], (key, dest, got)
            else:
                assert str(got) == str(values[key]), (key, dest, got)


def test_cuda_graphs_left_on_are_not_disabled(sglang_parsed: dict[str, dict]) -> None:
    on = sglang_parsed["full-gpu-graphs-on"]["args"]
    assert "disabled" not in str(on["cuda_graph_backend_decode"]) and str(on["cuda_graph_max_bs_decode"]) == "32"
    cpu = sglang_parsed["cpu-defaults"]["args"]
    assert cpu["device"] == "cpu" and cpu["attention_backend"] == "torch_native" and cpu["sleep_on_idle"] is True


def test_every_key_is_a_flag_or_named_as_not_one() -> None:
    keys = set(EngineConfig.model_fields)
    assert set(ENGINE_FLAGS) | NOT_FLAGS == keys, (
        f"keys with no flag: {sorted(keys - set(ENGINE_FLAGS) - NOT_FLAGS)} (add them to launch.argv.ENGINE_FLAGS, "
        f"or to NOT_FLAGS if they are the launcher's own); table keys EngineConfig lacks: {sorted(set(ENGINE_FLAGS) - keys)}"
    )
    assert not set(ENGINE_FLAGS) & NOT_FLAGS


def test_every_flag_is_exercised_by_a_variant() -> None:
    """A new key gets its value checked by SGLang's parser only if some variant passes it: give it one in FULL."""
    passed = {
        key
        for engine in VARIANTS.values()
        for key, value in flag_values(engine, port=PORT, served_model_name="key").items()
        if key in ENGINE_FLAGS and ENGINE_FLAGS[key].argv(value)
    }
    assert passed == set(ENGINE_FLAGS), f"never passed by any variant: {sorted(set(ENGINE_FLAGS) - passed)}"


def test_docs_engine_reference_is_the_flag_table() -> None:
    assert engine_reference_table() in ENGINE_REFERENCE_PAGE.read_text(), (
        "docs/configuration.md's engine section reference differs from launch/config.py + launch/argv.py: paste the output of "
        "python -c 'from launch.argv import engine_reference_table as t; print(t())'"
    )


def test_a_misspelled_flag_is_caught_by_the_parser_check(sglang_parsed: dict[str, dict]) -> None:
    """The check itself can fail: SGLang's parser rejects an unknown flag."""
    result = sglang_parsed["misspelled"]
    assert result["ok"] is False and "--disable-cuda-graphs" in " ".join(result["error"])


@pytest.mark.parametrize("preset", list(PRESETS))
def test_shipped_gpu_presets_pass_preflight_and_sglangs_parser(sglang_parsed: dict[str, dict], preset: str) -> None:
    name, engine = PRESETS[preset]
    result = sglang_parsed[preset]
    assert result["ok"], f"SGLang rejected the argv of {preset}: {result.get('error')}"
    parsed = result["args"]
    assert parsed["model_path"] == engine.model_path and parsed["served_model_name"] == name
    for field in ("dtype", "context_length", "mem_fraction_static", "chunked_prefill_size", "grammar_backend", "tool_call_parser", "tp_size"):
        assert str(parsed[field]) == str(getattr(engine, field)), field
    assert engine.cuda_graph and str(parsed["cuda_graph_max_bs_decode"]) == str(engine.cuda_graph_max_bs)
    assert "disabled" not in str(parsed["cuda_graph_backend_decode"])  # the toolkit was found: graphs stay on


def test_engine_keys_never_look_like_an_option() -> None:
    """SGLang reads the key from its config file as an argument: one starting with ``-`` would be taken for an
    option and the engine would not start (one in 64 of ``token_urlsafe``'s keys did)."""
    keys = {new_engine_key() for _ in range(2000)}
    assert len(keys) == 2000 and not [key for key in keys if key.startswith("-")]
