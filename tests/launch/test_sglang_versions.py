"""The SGLang version table (launch/sglang_versions.py) against the pinned facts of each version, and what the
launcher and the gateway do with it: an engine of an older version gets its own flag spellings, a setting or a
request field it lacks is refused naming the version.

The older version's own parser and real engine are exercised by ``make test-sglang-0.5.10.post1`` (its own
environment); here its facts are the pinned copy made from its installed sources by scripts/sglang_facts.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from launch.argv import ENGINE_FLAGS, Passed, flag_values, server_args
from launch.config import EngineConfig
from launch.sglang_versions import (
    FACTS_DIR,
    NEWEST,
    VERSIONS,
    UnsupportedSglang,
    engine_version,
    facts,
)
from tests.fake_engine import running_fake_engine
from tests.gateway_server import GatewayServer, serve
from tests.launch.test_argv import VARIANTS

REPO = Path(__file__).resolve().parents[2]
OLD = "0.5.10.post1"


def test_every_version_has_facts_and_the_facts_say_which_version() -> None:
    assert {path.stem for path in FACTS_DIR.glob("*.json")} == set(VERSIONS)
    for version in VERSIONS:
        assert facts(version)["sglang"] == version


@pytest.mark.parametrize("version", list(VERSIONS))
def test_each_entry_covers_exactly_the_flags_its_version_lacks(version: str) -> None:
    entry, flags = VERSIONS[version], set(facts(version)["flags"])
    ours = {flag for engine_flag in ENGINE_FLAGS.values() for flag in engine_flag.flags}
    lacking = ours - flags
    covered = set(entry.missing_flags) | entry.always_on | set(entry.renamed_flags)
    if entry.cuda_graph_off:
        covered |= {flag for f in ENGINE_FLAGS.values() if f.passed is Passed.OFF for flag in f.flags}
    assert covered == lacking, f"SGLang {version}: flags lacking but not in its entry {lacking - covered}; stale {covered - lacking}"
    assert set(entry.renamed_flags.values()) <= flags and set(entry.cuda_graph_off) <= flags


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("version", list(VERSIONS))
def test_every_argv_is_spelled_in_its_versions_flags(version: str, variant: str) -> None:
    engine, entry = VARIANTS[variant], VERSIONS[version]
    values = flag_values(engine, port=30000, served_model_name="m")
    sets_missing = [key for key, flag in ENGINE_FLAGS.items() if flag.argv(values[key]) and flag.flags[0] in entry.missing_flags]
    if sets_missing and not (entry.cuda_graph_off and all(ENGINE_FLAGS[k].passed is Passed.OFF for k in sets_missing)):
        with pytest.raises(UnsupportedSglang, match=rf"^engine\.{sets_missing[0]}: SGLang {version} has no "):
            server_args(engine, port=30000, served_model_name="m", version=entry)
        return
    argv = server_args(engine, port=30000, served_model_name="m", version=entry)
    known = set(facts(version)["flags"])
    assert [arg for arg in argv if arg.startswith("--") and arg not in known and arg not in engine.extra_args] == []


def test_an_older_engine_gets_its_own_spellings() -> None:
    old = engine_version(OLD)
    gpu = EngineConfig(model_path="org/m", cuda_graph_max_bs=16, enable_response_store=True)
    argv = server_args(gpu, port=1, version=old)
    assert argv[argv.index("--cuda-graph-max-bs") + 1] == "16" and "--cuda-graph-max-bs-decode" not in argv
    assert "--enable-response-store" not in server_args(gpu, port=1, version=old)  # always on there
    assert "--enable-response-store" in server_args(gpu, port=1, version=engine_version(NEWEST))
    off = EngineConfig(model_path="org/m", cuda_graph=False)
    assert server_args(off, port=1, version=old)[-1] == "--disable-cuda-graph"
    with pytest.raises(UnsupportedSglang) as refused:
        server_args(EngineConfig(model_path="org/m", otlp_service_name="svc"), port=1, version=old)
    assert str(refused.value) == (
        f"engine.otlp_service_name: SGLang {OLD} has no --otlp-service-name (its spans are always named sglang); "
        f"remove the setting or use SGLang {NEWEST}"
    )
    cpu = EngineConfig(model_path="org/m", device="cpu")
    argv = server_args(cpu, port=1, version=old)
    assert argv[argv.index("--grammar-backend") + 1] == "outlines"  # its xgrammar masks on GPUs only
    compact = server_args(cpu.model_copy(update={"json_disable_any_whitespace": True}), port=1, version=old)
    assert compact[compact.index("--constrained-json-whitespace-pattern") + 1] == ""  # what outlines reads
    assert "--constrained-json-disable-any-whitespace" not in compact
    assert "--grammar-backend" not in server_args(cpu, port=1, version=engine_version(NEWEST))
    with pytest.raises(UnsupportedSglang, match=r"^engine\.grammar_backend: SGLang 0\.5\.10\.post1's xgrammar backend"):
        server_args(cpu.model_copy(update={"grammar_backend": "xgrammar"}), port=1, version=old)
    with pytest.raises(UnsupportedSglang, match=r"^SGLang 0\.5\.19 is not a supported version \(supported: "):
        engine_version("0.5.19")


def test_request_fields_an_older_engine_would_ignore_are_named() -> None:
    old = engine_version(OLD)
    assert old.field_problem("/v1/responses", {"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}}) == (
        f"text: the engine runs SGLang {OLD}, which does not support this field on /v1/responses"
    )
    assert old.field_problem("/v1/chat/completions", {"model": "m", "messages": [], "max_tokens": 4}) is None
    assert engine_version(NEWEST).field_problem("/v1/responses", {"text": {}}) is None
    assert engine_version(NEWEST).missing_fields == {}


@pytest.fixture(scope="module")
def old_fake_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A FAKE engine that says it runs SGLang 0.5.10.post1 (its /get_server_info), behind a ``url:`` model."""
    os.environ["FAKE_ENGINE_SGLANG_VERSION"] = OLD
    try:
        with running_fake_engine(tmp_path_factory.mktemp("old-engine")) as url:
            yield url
    finally:
        os.environ.pop("FAKE_ENGINE_SGLANG_VERSION", None)


@pytest.fixture(scope="module")
def gateway(old_fake_engine: str) -> Iterator[GatewayServer]:
    with serve({"m": {"url": old_fake_engine}}) as server:
        yield server


def test_a_gateway_refuses_fields_the_url_engines_version_lacks(gateway: GatewayServer) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        assert client.get("/ready").status_code == 200  # the first ready answer learns the engine's version
        refused = client.post("/v1/responses", json={"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "text" and f"SGLang {OLD}" in error["message"]
        answered = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert answered.status_code == 200, answered.text
