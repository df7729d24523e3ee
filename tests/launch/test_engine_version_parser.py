"""Every engine variant's argv, spelled for the SGLang of the engine python, parsed by that SGLang's own parser.

In the main suite the engine python is this environment's (SGLang 0.5.23); ``make test-sglang-0.5.10.post1`` runs
it with $SGLANG_GATEWAY_ENGINE_PYTHON naming the older version's environment, so the older spellings
(``--cuda-graph-max-bs``, ``--disable-cuda-graph``, no ``--enable-response-store``) meet the older parser.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from launch.argv import build_env, launch_version, server_args
from launch.config import EngineConfig
from launch.sglang_versions import UnsupportedSglang
from tests.launch.test_argv import PARSED_FIELDS, VARIANTS

HERE = Path(__file__).resolve().parent
PROBE = EngineConfig(model_path="org/m", device="cpu")  # its python: $SGLANG_GATEWAY_ENGINE_PYTHON, else this one
# Settings every supported version takes, spelled differently by each (the variants of test_argv set some that
# older versions lack).
GRAPHS = {
    "graphs-on": EngineConfig(model_path="org/m", cuda_graph=True, cuda_graph_max_bs=32, enable_response_store=True),
    "graphs-off": EngineConfig(model_path="org/m", cuda_graph=False),
}


@pytest.fixture(scope="module")
def parsed(tiny_model_dir: Path) -> dict[str, dict]:
    """Each variant's argv for the engine python's version, through that version's ``prepare_server_args`` (with
    the tiny model's local path: older versions read the model's config while parsing)."""
    version = launch_version(PROBE)
    argvs: dict[str, list[str]] = {}
    for name, engine in {**VARIANTS, **GRAPHS}.items():
        try:
            argv = server_args(engine, port=30000, served_model_name="m", version=version)
        except UnsupportedSglang:
            continue  # a setting that version lacks: test_sglang_versions.py checks the refusal
        argvs[name] = [str(tiny_model_dir) if arg == "org/m" else arg for arg in argv]
    proc = subprocess.run(
        [PROBE.python_executable, str(HERE / "sglang_parse_argv.py")],
        input=json.dumps({"fields": [*PARSED_FIELDS, "disable_cuda_graph", "cuda_graph_max_bs"], "argvs": list(argvs.values())}),
        capture_output=True, text=True, timeout=300, check=False, env=build_env(PROBE).variables,
    )  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line, f"parser script failed:\n{proc.stderr[-3000:]}"
    return {"version": version.sglang, **dict(zip(argvs, json.loads(line.removeprefix("RESULTS ")), strict=True))}


def test_the_engine_python_s_parser_accepts_each_argv(parsed: dict[str, dict]) -> None:
    variants = {name: result for name, result in parsed.items() if name != "version"}
    assert "minimal-gpu" in variants and "cpu-defaults" in variants
    rejected = {name: result.get("error") for name, result in variants.items() if not result["ok"]}
    assert rejected == {}, f"SGLang {parsed['version']} rejected: {rejected}"


def test_cuda_graph_settings_land_in_the_engine_s_own_fields(parsed: dict[str, dict]) -> None:
    on, off = parsed["graphs-on"]["args"], parsed["graphs-off"]["args"]
    if parsed["version"] == "0.5.23":
        assert str(on["cuda_graph_max_bs_decode"]) == "32" and "disabled" not in str(on["cuda_graph_backend_decode"])
        assert "disabled" in str(off["cuda_graph_backend_decode"]) and "disabled" in str(off["cuda_graph_backend_prefill"])
        assert on["enable_response_store"] is True
    else:  # the older spellings: one max batch size, one switch; its Responses store needs no flag
        assert str(on["cuda_graph_max_bs"]) == "32" and on["disable_cuda_graph"] is False
        assert off["disable_cuda_graph"] is True
