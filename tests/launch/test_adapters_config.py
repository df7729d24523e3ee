"""``models.<name>.adapters``: the engine keys they set, the flags SGLang gets, and the mistakes refused with a
message naming the key (no engine here: tests/gateway/test_adapters_engine.py serves them)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from launch.argv import build_argv
from launch.config import ConfigError, parse_config
from tests.docs.readme_blocks import marked_blocks


def _deployment(entry: dict[str, Any]) -> Any:
    return parse_config({"models": {"tiny": entry}}, "deploy.yaml")


def test_adapters_load_at_start_with_the_cpu_kernels_and_their_names() -> None:
    engine = _deployment(
        {"engine": {"model_path": "/m", "device": "cpu", "max_loras_per_batch": 2}, "adapters": {"a1": "/ad/1", "b.2": "/ad/2"}}
    ).engine("tiny")
    assert engine.enable_lora and engine.lora_paths == {"a1": "/ad/1", "b.2": "/ad/2"}
    argv = build_argv(engine, port=30000, served_model_name="tiny")
    flags = argv[argv.index("--lora-paths") :]
    assert flags[:3] == ["--lora-paths", "a1=/ad/1", "b.2=/ad/2"] and "--enable-lora" in argv
    assert argv[argv.index("--lora-backend") + 1] == "torch_native"  # SGLang's default kernels need a GPU
    assert argv[argv.index("--max-loras-per-batch") + 1] == "2"
    gpu = _deployment({"engine": {"model_path": "/m"}, "adapters": {"a1": "/ad/1"}}).engine("tiny")
    assert "--lora-backend" not in build_argv(gpu, port=30000, served_model_name="tiny")  # SGLang's choice on a GPU


def test_a_dumped_config_with_adapters_reads_back() -> None:
    """What ``log_model`` does with a YAML file: dump the models and parse them again (the engine then says
    ``lora_paths`` too, the same as ``adapters``)."""
    deployment = _deployment({"engine": {"model_path": "/m", "device": "cpu"}, "adapters": {"a1": "/ad/1"}})
    dumped = deployment.model_dump(mode="json", exclude_defaults=True)["models"]
    assert dumped["tiny"]["engine"]["lora_paths"] == {"a1": "/ad/1"}
    assert parse_config({"models": dumped}, "deploy.yaml").models["tiny"] == deployment.models["tiny"]


def test_no_adapters_no_lora_flags() -> None:
    argv = build_argv(_deployment({"engine": {"model_path": "/m", "device": "cpu"}}).engine("tiny"), port=30000, served_model_name="t")
    assert not [flag for flag in argv if "lora" in flag]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"url": "http://127.0.0.1:1", "adapters": {"a": "/p"}}, "models.tiny: adapters need an 'engine' section"),
        ({"engine": {"model_path": "/m"}, "adapters": {"a:b": "/p"}}, "adapter name 'a:b': letters, digits"),
        ({"engine": {"model_path": "/m"}, "adapters": {"a": " "}}, "adapter 'a': the path is empty"),
        ({"engine": {"model_path": "/m", "lora_paths": {"a": "/q"}}, "adapters": {"a": "/p"}}, "give LoRA adapters once"),
        ({"engine": {"model_path": "/m"}, "adapters": {"a": "/p"}, "adapter_aliases": {"x": "b"}}, "adapter_aliases.x: no adapter named 'b'"),
        ({"engine": {"model_path": "/m"}, "adapters": {"a": "/p"}, "adapter_aliases": {"tiny": "a"}}, "adapter alias 'tiny' is a name of model 'tiny'"),
        ({"engine": {"model_path": "/m", "lora_paths": {"a": "/p"}}}, "lora_paths needs enable_lora: true"),
        ({"engine": {"model_path": "/m", "lora_eviction_policy": "random"}}, "lora_eviction_policy"),
    ],
)
def test_adapter_mistakes_name_the_key(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _deployment(entry)
    assert message in str(caught.value), str(caught.value)


def test_the_documented_adapters_config_is_what_the_page_says() -> None:
    (block,) = marked_blocks("adapters-config")
    deployment = parse_config(yaml.safe_load(block.code), "docs/adapters.md")
    entry = deployment.models["llama"]
    assert list(entry.adapters) == ["support", "legal"]
    engine = deployment.engine("llama")
    assert engine.enable_lora and engine.lora_paths == entry.adapters and engine.max_loras_per_batch == 4
