"""Every way a deployment YAML can be wrong gets one line naming the file, the key and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.config import ConfigError, load_config, parse_config

GOOD_ENGINE = "engine:\n      model_path: org/model\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(str(path)), message
    assert "Traceback" not in message
    return message


def test_minimal_config_gets_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, f"models:\n  m:\n    {GOOD_ENGINE}"))
    engine = config.engine("m")
    assert engine.device == "cuda" and engine.port == 0 and engine.tp_size == 1
    assert engine.cuda_graph_enabled is True
    assert config.source == tmp_path / "deploy.yaml"


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        (f"models:\n  m:\n    {GOOD_ENGINE}bogus: 1\n", "bogus", "unknown key"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      tp_szie: 2\n", "models.m.engine.tp_szie", "unknown key"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      colour: red\n", "models.m.engine.colour", "unknown key"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      tp_size: two\n", "models.m.engine.tp_size", "integer"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      tp_size: 0\n", "models.m.engine.tp_size", "greater than or equal to 1"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      dp_size: -1\n", "models.m.engine.dp_size", "greater than or equal to 1"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      port: 70000\n", "models.m.engine.port", "less than or equal to 65535"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      mem_fraction_static: 1.5\n", "models.m.engine.mem_fraction_static", "less than 1"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      max_total_tokens: 0\n", "models.m.engine.max_total_tokens", "greater than 0"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      context_length: -5\n", "models.m.engine.context_length", "greater than 0"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      chunked_prefill_size: -7\n", "models.m.engine.chunked_prefill_size", "-1 to disable"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      dtype: fp7\n", "models.m.engine.dtype", "'auto'"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      device: tpu\n", "models.m.engine.device", "'cuda' or 'cpu'"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      grammar_backend: regexy\n", "models.m.engine.grammar_backend", "xgrammar"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      cuda_graph: maybe\n", "models.m.engine.cuda_graph", "boolean"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      device: cpu\n      cuda_graph: true\n", "models.m.engine", "needs device: cuda"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      device: cpu\n      cuda_graph_max_bs: 8\n", "models.m.engine", "needs device: cuda"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      cuda_graph: false\n      cuda_graph_max_bs: 8\n", "models.m.engine", "cuda_graph is false"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      extra_args: [fp8]\n", "models.m.engine.extra_args", "must start with a flag"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      extra_args: --x\n", "models.m.engine.extra_args", "valid list"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      env: {{A: [1]}}\n", "models.m.engine.env", "env.A must be a string"),
        (f"models:\n  m:\n    {GOOD_ENGINE}      startup_timeout_s: 0\n", "models.m.engine.startup_timeout_s", "greater than 0"),
        ("models:\n  m:\n    engine:\n      dtype: float32\n", "models.m.engine.model_path", "required key is missing"),
        ("models:\n  m:\n    engine:\n      model_path: '  '\n", "models.m.engine.model_path", "must not be empty"),
        ("models:\n  m:\n    aliases: [x]\n", "models.m", "exactly one of 'engine'"),
        (f"models:\n  m:\n    url: http://h:1\n    {GOOD_ENGINE}", "models.m", "exactly one of 'engine'"),
        ("models:\n  m:\n    url: ftp://h\n", "models.m.url", "http(s) URL"),
        ("models: {}\n", "models", "at least 1 item"),
        (f"models:\n  m:\n    api_key: k\n    {GOOD_ENGINE}", "models.m", "belong to a 'url' model"),
        ("gateway: {}\n", "models", "required key is missing"),
        (f"models:\n  m:\n    aliases: [a]\n    {GOOD_ENGINE}  n:\n    aliases: [a]\n    {GOOD_ENGINE}", "models", "'a' is used by both"),
        (f"models:\n  'bad name':\n    {GOOD_ENGINE}", "models", "not a valid model name"),
        ("models:\n  m: 3\n", "models.m", "valid dictionary"),
    ],
)
def test_bad_values_name_file_key_and_reason(tmp_path: Path, text: str, key: str, reason: str) -> None:
    message = error_of(tmp_path, text)
    assert f": {key}: " in message, message
    assert reason in message, message


def test_each_problem_is_one_line(tmp_path: Path) -> None:
    message = error_of(tmp_path, f"models:\n  m:\n    {GOOD_ENGINE}      tp_size: 0\n      port: -1\n")
    lines = message.splitlines()
    assert len(lines) == 2
    assert any("tp_size" in line for line in lines) and any("port" in line for line in lines)


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    message = error_of(tmp_path, "models:\n  m: [unclosed\n")
    assert "invalid YAML" in message and "line" in message and "\n" not in message


def test_not_a_mapping(tmp_path: Path) -> None:
    assert "expected a mapping" in error_of(tmp_path, "- a\n- b\n")


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such file$"):
        load_config(tmp_path / "nope.yaml")


def test_env_expansion_and_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL_DIR", "org/from-env")
    config = load_config(
        write(tmp_path, "models:\n  m:\n    engine:\n      model_path: ${MODEL_DIR}\n      tokenizer_path: ${TOK:-org/tok}\n")
    )
    assert config.engine("m").model_path == "org/from-env"
    assert config.engine("m").tokenizer_path == "org/tok"


def test_unset_env_without_default_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    message = error_of(tmp_path, "models:\n  m:\n    engine:\n      model_path: ${NOT_SET_ANYWHERE}\n")
    assert "NOT_SET_ANYWHERE is not set" in message


def test_relative_model_path_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "d.yaml"
    path.write_text("models:\n  m:\n    engine:\n      model_path: ../weights\n")
    assert load_config(path).engine("m").model_path == str(tmp_path / "weights")


def test_env_scalars_become_strings(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, f"models:\n  m:\n    {GOOD_ENGINE}      env: {{A: 1, B: true, C: x}}\n"))
    assert config.engine("m").env == {"A": "1", "B": "1", "C": "x"}


def test_engine_lookup_errors(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, f"models:\n  m:\n    {GOOD_ENGINE}  ext:\n    url: http://h:9/\n"))
    assert config.models["ext"].url == "http://h:9"
    assert set(config.managed()) == {"m"}
    with pytest.raises(ConfigError, match="no model named 'zz'"):
        config.engine("zz")
    with pytest.raises(ConfigError, match="has a url"):
        config.engine("ext")


def test_parse_config_accepts_dicts_and_rejects_junk() -> None:
    config = parse_config({"models": {"m": {"engine": {"model_path": "org/m", "device": "cpu"}}}}, "model_config")
    assert config.engine("m").cuda_graph_enabled is False
    with pytest.raises(ConfigError, match=r"^model_config: models\.m\.engine\.wat: unknown key$"):
        parse_config({"models": {"m": {"engine": {"model_path": "org/m", "wat": 1}}}}, "model_config")


def test_shipped_configs_are_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert len(configs) >= 3
    for path in configs:
        config = load_config(path)
        assert config.models, path


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"url": "http://h:1", "replicas": 2}, "replicas, replica_gpus and router need an 'engine' section"),
        ({"engine": {"model_path": "m", "port": 30000}, "replicas": 2}, "cannot share engine.port 30000"),
        ({"engine": {"model_path": "m", "device": "cpu"}, "replicas": 2, "replica_gpus": [[0], [1]]}, "replica_gpus needs device: cuda"),
        ({"engine": {"model_path": "m"}, "replicas": 2, "replica_gpus": [[0]]}, "replica_gpus lists 1 replica(s), replicas is 2"),
        ({"engine": {"model_path": "m", "tp_size": 2}, "replicas": 2, "replica_gpus": [[0, 1], [2]]}, "replica_gpus[1] has 1 GPU(s); tp_size x dp_size = 2"),
        ({"engine": {"model_path": "m"}, "replicas": 2, "replica_gpus": [[0], [0]]}, "GPU ids must be distinct"),
        ({"engine": {"model_path": "m"}, "replicas": 0}, "replicas: Input should be greater than or equal to 1"),
    ],
)
def test_replica_settings_are_checked(model: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"models": {"m": model}}, "d.yaml")
    assert message in str(caught.value) and str(caught.value).startswith("d.yaml: models.m")


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"nnodes": 2}, "nnodes > 1 needs dist_init_addr"),
        ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "10.0.0.1:5000"}, "node_rank 2 must be below nnodes 2"),
        ({"nnodes": 2, "dist_init_addr": "10.0.0.1"}, "dist_init_addr must be host:port, got '10.0.0.1'"),
        ({"nnodes": 0}, "nnodes: Input should be greater than or equal to 1"),
    ],
)
def test_multi_machine_keys_are_checked(engine: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"models": {"m": {"engine": {"model_path": "m", **engine}}}}, "d.yaml")
    assert message in str(caught.value) and str(caught.value).startswith("d.yaml: models.m.engine")


def test_an_engine_spanning_machines_takes_its_rank_and_has_no_replicas() -> None:
    spread = {"model_path": "m", "tp_size": 16, "nnodes": 2, "dist_init_addr": "head-0.workers:5000"}
    follower = parse_config({"models": {"m": {"engine": {**spread, "node_rank": 1}}}}).engine("m")
    assert (follower.nnodes, follower.node_rank, follower.dist_init_addr) == (2, 1, "head-0.workers:5000")
    assert parse_config({"models": {"m": {"engine": {**spread, "dist_init_addr": "[fd00::1]:5000"}}}})
    with pytest.raises(ConfigError) as caught:
        parse_config({"models": {"m": {"engine": spread, "replicas": 2}}}, "d.yaml")
    assert "an engine spanning machines (nnodes > 1) has none" in str(caught.value)


def test_replica_gpus_slices_and_fit() -> None:
    from launch.replicas import replica_engines

    entry = parse_config({"models": {"m": {"engine": {"model_path": "m", "tp_size": 2}, "replicas": 3}}}).models["m"]
    envs = [engine.env["CUDA_VISIBLE_DEVICES"] for engine in replica_engines(entry, [str(i) for i in range(8)])]
    assert envs == ["0,1", "2,3", "4,5"]
    with pytest.raises(ConfigError, match=r"3 replica\(s\) x tp_size x dp_size 2 = 6 GPUs needed, 4 visible"):
        replica_engines(entry, ["0", "1", "2", "3"])
    listed = parse_config({"models": {"m": {"engine": {"model_path": "m"}, "replicas": 2, "replica_gpus": [[3], [1]]}}}).models["m"]
    assert [e.env["CUDA_VISIBLE_DEVICES"] for e in replica_engines(listed, ["0", "1", "2", "3"])] == ["3", "1"]
    with pytest.raises(ConfigError, match="names GPU"):
        replica_engines(listed, ["0", "1"])
    cpu = parse_config({"models": {"m": {"engine": {"model_path": "m", "device": "cpu"}, "replicas": 2}}}).models["m"]
    assert [e.env for e in replica_engines(cpu, [])] == [{}, {}]
