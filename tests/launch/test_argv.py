"""The argv builder: flag mapping, CPU defaults, and every argv checked by SGLang's own parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch.argv import (
    CPU_ENGINE_ENV,
    CPU_SHIM_DIR,
    build_argv,
    build_env,
    server_args,
)
from launch.config import CPU_DEFAULT_MAX_TOTAL_TOKENS, EngineConfig, load_config
from launch.preflight import preflight, require

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


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
    env = build_env(EngineConfig(model_path="org/m", device="cpu", env={"OMP_NUM_THREADS": "2"}), base={"PYTHONPATH": "/x"})
    assert env.variables[CPU_ENGINE_ENV] == "1"
    assert env.uses_cpu_shim  # this environment has no real sgl_kernel
    assert env.variables["PYTHONPATH"].split(":") == [str(CPU_SHIM_DIR), "/x"]
    assert env.variables["OMP_NUM_THREADS"] == "2"
    gpu = build_env(EngineConfig(model_path="org/m"), base={})
    assert CPU_ENGINE_ENV not in gpu.variables and "PYTHONPATH" not in gpu.variables and not gpu.uses_cpu_shim


def test_cpu_shim_stays_off_when_a_real_sgl_kernel_imports(tmp_path: Path) -> None:
    real = tmp_path / "site" / "sgl_kernel"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("")
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\nPYTHONPATH={real.parent} exec {sys.executable} \"$@\"\n")
    fake_python.chmod(0o755)
    env = build_env(EngineConfig(model_path="org/m", device="cpu", python=str(fake_python)), base={})
    assert not env.uses_cpu_shim and "PYTHONPATH" not in env.variables


FULL = dict(
    model_path="org/m",
    tokenizer_path="org/tok",
    served_model_name="served",
    host="0.0.0.0",
    tp_size=2,
    dp_size=2,
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
    return require(preflight(engine, gpu_count=gpus, cuda_home="/usr/local/cuda"), name)


def test_there_are_gpu_presets() -> None:
    assert len(PRESETS) >= 2, PRESETS


@pytest.fixture(scope="module")
def sglang_parsed() -> dict[str, dict]:
    """Every variant's and preset's argv parsed by ``sglang.srt.server_args.prepare_server_args`` (one subprocess)."""
    pytest.importorskip("sglang")
    argvs = [server_args(engine, port=30123, served_model_name="key") for engine in VARIANTS.values()]
    argvs += [server_args(launched_preset(preset), port=8001, served_model_name=PRESETS[preset][0]) for preset in PRESETS]
    argvs.append(MISSPELLED)
    proc = subprocess.run(
        [sys.executable, str(HERE / "sglang_parse_argv.py")],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line, f"parser script failed:\n{proc.stderr[-3000:]}"
    return dict(zip([*VARIANTS, *PRESETS, "misspelled"], json.loads(line.removeprefix("RESULTS ")), strict=True))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sglang_accepts_every_argv(sglang_parsed: dict[str, dict], variant: str) -> None:
    result = sglang_parsed[variant]
    assert result["ok"], f"SGLang rejected the argv for {variant}: {result.get('error')}"


def test_sglang_reads_each_value_where_we_meant_it(sglang_parsed: dict[str, dict]) -> None:
    parsed = sglang_parsed["full-gpu-graphs-off"]["args"]
    for field in ("model_path", "tokenizer_path", "host", "tp_size", "dp_size", "mem_fraction_static",
                  "max_total_tokens", "context_length", "max_running_requests", "dtype", "quantization",
                  "chunked_prefill_size", "grammar_backend", "tool_call_parser", "reasoning_parser",
                  "chat_template", "attention_backend", "random_seed", "trust_remote_code",
                  "skip_server_warmup", "sleep_on_idle"):
        assert str(parsed[field]) == str(FULL[field]), field
    assert parsed["served_model_name"] == "served"
    assert parsed["port"] == 30123
    assert parsed["constrained_json_disable_any_whitespace"] is True
    assert "disabled" in str(parsed["cuda_graph_backend_decode"])
    assert "disabled" in str(parsed["cuda_graph_backend_prefill"])
    on = sglang_parsed["full-gpu-graphs-on"]["args"]
    assert str(on["cuda_graph_max_bs_decode"]) == "32"
    assert "disabled" not in str(on["cuda_graph_backend_decode"])
    cpu = sglang_parsed["cpu-defaults"]["args"]
    assert cpu["device"] == "cpu" and cpu["attention_backend"] == "torch_native" and cpu["sleep_on_idle"] is True


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
