"""Facts about a model read from its files, without loading it (no torch, no transformers).

The gateway needs the vocabulary size before a request reaches an engine: SGLang 0.5.23 does not check
prompt token ids against it, and one id outside ``[0, vocab_size)`` crashes the engine's scheduler.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_NESTED_CONFIGS = ("text_config", "llm_config", "language_config")  # multimodal models keep the LM's here


def model_config_file(model_path: str) -> Path | None:
    """The model's ``config.json``: in a local directory, or in the Hugging Face cache for a hub id."""
    local = Path(model_path).expanduser()
    if local.is_dir():
        found = local / "config.json"
        return found if found.is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(model_path, "config.json")
    except Exception:  # noqa: BLE001 - an id the hub library cannot parse is simply not in the cache
        return None
    return Path(cached) if isinstance(cached, str) else None


def vocab_size(model_path: str) -> int | None:
    """``vocab_size`` of the model at ``model_path`` (top level or its language model's config), or None."""
    path = model_config_file(model_path)
    if path is None:
        return None
    try:
        config: Any = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for section in (config, *(config.get(key) for key in _NESTED_CONFIGS)):
        if isinstance(section, dict) and isinstance(section.get("vocab_size"), int) and section["vocab_size"] > 0:
            return int(section["vocab_size"])
    return None


def tokenizer_dir(path: str) -> str | None:
    """A local directory holding the tokenizer of ``path`` (a model or tokenizer directory, or a hub id already in the
    local cache), or None: the grammar compile budget (:mod:`launch.grammar_cost`) measures against it."""
    local = Path(path).expanduser()
    if local.is_dir():
        return str(local) if any((local / name).is_file() for name in _TOKENIZER_FILES) else None
    found = model_config_file(path)
    if found is None or not any((found.parent / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return str(found.parent)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
