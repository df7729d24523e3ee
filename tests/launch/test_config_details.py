"""launch.config details: relative paths, environment values, the exact one-line errors (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from launch.config import ConfigError, EngineConfig, expand_env, format_validation_error, load_config, parse_config


def _refusal(data: object, *source: str) -> str:
    with pytest.raises(ConfigError) as refused:
        parse_config(data, *source)
    return str(refused.value)


def test_every_relative_path_of_every_engine_is_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "d.yaml"
    path.write_text(
        "models:\n"
        "  ext:\n    url: http://h:1\n"  # no engine section: skipped, the next model still resolved
        "  m:\n    engine:\n      model_path: ./weights\n      tokenizer_path: ../tok\n      chat_template: ./chat.jinja\n"
        "  hub:\n    engine:\n      model_path: org/model\n      tokenizer_path: /abs/tok\n      chat_template: chatml\n"
    )
    config = load_config(path)
    m, hub = config.engine("m"), config.engine("hub")
    assert m.model_path == str(tmp_path / "configs" / "weights")
    assert m.tokenizer_path == str(tmp_path / "tok") and m.chat_template == str(tmp_path / "configs" / "chat.jinja")
    assert (hub.model_path, hub.tokenizer_path, hub.chat_template) == ("org/model", "/abs/tok", "chatml")


def test_environment_values_of_every_scalar_type(tmp_path: Path) -> None:
    engine = EngineConfig(model_path="m", env={"ON": True, "OFF": False, "N": 3, "F": 0.5, "S": "x"})
    assert engine.env == {"ON": "1", "OFF": "0", "N": "3", "F": "0.5", "S": "x"}
    with pytest.raises(ValidationError, match="env.L must be a string, number or boolean"):
        EngineConfig(model_path="m", env={"L": [1]})


def test_a_problem_of_the_whole_section_is_at_the_top_level() -> None:
    with pytest.raises(ValidationError) as invalid:
        EngineConfig(model_path="m", nnodes=2)
    assert format_validation_error("src", invalid.value) == (
        "src: (top level): nnodes > 1 needs dist_init_addr (host:port of the machine with node_rank 0)"
    )


def test_each_problem_on_its_own_line() -> None:
    message = _refusal({"models": {"m": {"engine": {"model_path": "m", "tp_size": 0, "wat": 1}}}}, "d.yaml")
    assert message.split("\n") == [
        "d.yaml: models.m.engine.tp_size: Input should be greater than or equal to 1",
        "d.yaml: models.m.engine.wat: unknown key",
    ]
    assert _refusal({"gateway": {}}, "d.yaml") == "d.yaml: models: required key is missing"


def test_a_deployment_without_a_file() -> None:
    data = {"models": {"m": {"url": "http://h:1"}}}
    assert parse_config(data).source is None
    assert parse_config(data, "d.yaml").source == Path("d.yaml")
    assert _refusal(["m"]) == "<config>: expected a mapping with a 'models' key, got list"
    assert _refusal({"models": {}}).startswith("<config>: models: ")
    with pytest.raises(ConfigError) as refused:
        expand_env("model_path: ${SURELY_UNSET_VARIABLE}")
    assert str(refused.value) == "<config>: environment variable SURELY_UNSET_VARIABLE is not set (write ${SURELY_UNSET_VARIABLE:-default})"


def test_engine_lookup_errors_name_the_file_and_the_models(tmp_path: Path) -> None:
    data = {"models": {"m": {"engine": {"model_path": "m"}}, "ext": {"url": "http://h:1"}}}
    in_memory, from_file = parse_config(data), parse_config(data, "d.yaml")
    for config, where in ((in_memory, "config"), (from_file, "d.yaml")):
        with pytest.raises(ConfigError) as refused:
            config.engine("zz")
        assert str(refused.value) == f"{where}: no model named 'zz' (models: m, ext)"
        with pytest.raises(ConfigError) as refused:
            config.engine("ext")
        assert str(refused.value) == f"{where}: model 'ext' has a url, not an engine section"


def test_invalid_yaml_names_its_line_and_problem(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text("models:\n  m: [unclosed\n  n: 1\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value).startswith(f"{path}: line 3: invalid YAML: expected ',' or ']'")
    path.write_text("models:\n  m: \x07\n")  # not a parse error: a character YAML refuses to read (no line mark)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value) == f"{path}: invalid YAML: unacceptable character #x0007: special characters are not allowed"


def test_a_file_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path)  # a directory
    assert str(refused.value) == f"{tmp_path}: cannot read: Is a directory"


def test_replica_gpus_count_tensor_and_data_parallel_gpus_and_never_share_one() -> None:
    engine = {"model_path": "m", "tp_size": 2, "dp_size": 2}
    entry = parse_config({"models": {"m": {"engine": engine, "replicas": 2, "replica_gpus": [[0, 1, 2, 3], [4, 5, 6, 7]]}}}).models["m"]
    assert entry.replica_gpus == [[0, 1, 2, 3], [4, 5, 6, 7]]
    message = _refusal({"models": {"m": {"engine": {"model_path": "m"}, "replicas": 3, "replica_gpus": [[0], [1], [0]]}}}, "d.yaml")
    assert message == "d.yaml: models.m: replica_gpus[2]: GPU ids must be distinct non-negative numbers, got [0]"
    message = _refusal({"models": {"m": {"engine": {"model_path": "m", "device": "cpu"}, "replicas": 1, "replica_gpus": [[0]]}}}, "d.yaml")
    assert message == "d.yaml: models.m: replica_gpus needs device: cuda"
