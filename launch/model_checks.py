"""Preflight checks on what an engine would meet at start: its model's files, its memory, its GPUs' dtypes and its
extra flags, each caught before the engine takes its seconds (or minutes) to fail on it.

Each check reads files and pinned facts only (no torch, no SGLang import) and stays silent when it cannot tell:
a check that guessed would refuse models the engine runs.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.config import EngineConfig

# Files one of which a model directory's tokenizer comes in (Hugging Face, SentencePiece, tiktoken, Mistral).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "tekken.json")
_TOKENIZER_SUFFIXES = (".tiktoken", ".model")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
# Config keys of attention whose KV cache the plain formula does not describe (MLA, hybrid and sliding layers).
_UNUSUAL_ATTENTION = ("kv_lora_rank", "full_attention_interval", "hybrid_override_pattern", "attn_type_list", "sliding_window_pattern")


@dataclass(frozen=True)
class GpuFacts:
    """What the preflight needs of one visible GPU."""

    compute_capability: tuple[int, int]
    memory_mib: int


def _local_dir(path: str | None) -> Path | None:
    if not path:
        return None
    local = Path(path).expanduser()
    return local if local.is_dir() else None


def _extra_flag(engine: EngineConfig, flag: str) -> str | None:
    """The value ``extra_args`` gives ``flag`` (``""`` for a bare switch), or None when it is not there."""
    args = list(engine.extra_args)
    for index, arg in enumerate(args):
        if arg == flag:
            following = args[index + 1] if index + 1 < len(args) else ""
            return "" if following.startswith("--") else following
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def check_tokenizer(engine: EngineConfig) -> list[str]:
    """A local model directory with weights but no tokenizer (a converted or partly copied model) fails in the
    engine after its weights are read; say so now, unless ``tokenizer_path`` names one or the engine skips it."""
    if _extra_flag(engine, "--skip-tokenizer-init") is not None:
        return []
    if engine.tokenizer_path is not None:  # a directory of its own, or a Hugging Face id
        where = _local_dir(engine.tokenizer_path)
        if where is None or _has_tokenizer(where):
            return []
        return [f"tokenizer_path {engine.tokenizer_path}: no tokenizer in this directory ({', '.join(_TOKENIZER_FILES[:3])}...)"]
    model = _local_dir(engine.model_path)
    if model is None or _has_tokenizer(model) or not any(p.suffix in _WEIGHT_SUFFIXES for p in model.iterdir()):
        return []
    return [
        f"model_path {engine.model_path}: no tokenizer in this directory ({', '.join(_TOKENIZER_FILES[:3])}...): "
        "copy the model's tokenizer files there, or set tokenizer_path"
    ]


def _has_tokenizer(directory: Path) -> bool:
    names = {p.name for p in directory.iterdir()}
    return any(name in names for name in _TOKENIZER_FILES) or any(name.endswith(_TOKENIZER_SUFFIXES) for name in names) or any(
        name.endswith(".gguf") for name in names
    )


def _model_config(engine: EngineConfig) -> dict[str, Any] | None:
    model = _local_dir(engine.model_path)
    if model is None:
        return None
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    nested = next((config[key] for key in ("text_config", "llm_config", "language_config") if isinstance(config.get(key), dict)), None)
    return {**config, **nested} if nested else config


def kv_bytes_per_token(engine: EngineConfig) -> int | None:
    """Bytes of KV cache one token takes (keys and values of every layer), from the model's config.json; None for
    a model the plain formula does not describe (MLA, linear-attention hybrids) or cannot be read. A lower bound
    where ``layer_types`` names sliding-window layers (their cache is bounded by the window)."""
    config = _model_config(engine)
    if config is None or any(key in config for key in _UNUSUAL_ATTENTION):
        return None
    layers, heads, hidden = config.get("num_hidden_layers"), config.get("num_attention_heads"), config.get("hidden_size")
    if not all(isinstance(value, int) and value > 0 for value in (layers, heads, hidden)):
        return None
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):  # only full-attention layers keep every token (sliding ones a window)
        layers = sum(1 for kind in layer_types if kind == "full_attention")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    kv_dtype = _extra_flag(engine, "--kv-cache-dtype") or ""
    if kv_dtype.startswith(("fp8", "fp4", "int8")):
        dtype_bytes = 1
    else:
        dtype = engine.dtype if engine.dtype != "auto" else str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        dtype_bytes = _DTYPE_BYTES.get(dtype, 2)
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def memory_bytes(engine: EngineConfig, gpus: list[GpuFacts] | None) -> int | None:
    """The memory the engine's KV cache lives in: this machine's RAM on cpu, its GPUs' (tp_size of them) on cuda."""
    if engine.device == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    if not gpus:
        return None
    return sum(gpu.memory_mib for gpu in gpus[: engine.tp_size]) << 20


def check_max_total_tokens(engine: EngineConfig, gpus: list[GpuFacts] | None) -> list[str]:
    """``max_total_tokens`` whose KV cache alone is larger than the memory: SGLang then starts with the tokens
    that fit (it logs "larger than the profiled value"); the preflight says so, with the numbers."""
    if engine.max_total_tokens is None:
        return []
    per_token, memory = kv_bytes_per_token(engine), memory_bytes(engine, gpus)
    if per_token is None or memory is None or per_token * engine.max_total_tokens <= memory:
        return []
    where = "RAM" if engine.device == "cpu" else f"memory of {min(engine.tp_size, len(gpus or []))} GPU(s)"
    return [
        f"max_total_tokens {engine.max_total_tokens}: its KV cache takes about {per_token * engine.max_total_tokens / (1 << 30):,.0f} GiB "
        f"({per_token} bytes a token), more than the {memory / (1 << 30):,.0f} GiB of {where}: the engine will hold "
        f"about {memory // per_token:,} tokens at most, fewer beside the weights; lower it"
    ]


def check_dtype(engine: EngineConfig, gpus: list[GpuFacts] | None) -> list[str]:
    """bfloat16 needs compute capability 8.0 (Ampere) or newer; older GPUs fail in the engine's first kernels."""
    if engine.device != "cuda" or engine.dtype != "bfloat16" or not gpus:
        return []
    old = [gpu for gpu in gpus[: engine.tp_size] if gpu.compute_capability < (8, 0)]
    if not old:
        return []
    capability = ".".join(map(str, old[0].compute_capability))
    return [f"dtype bfloat16: this GPU's compute capability is {capability}, and bfloat16 needs 8.0 (Ampere) or newer: use dtype: float16"]


def check_extra_flags(engine: EngineConfig, known: list[str] | None, sglang: str) -> list[str]:
    """Each ``--flag`` of ``extra_args`` must be one of SGLang's (``known``: the pinned flags of its version,
    :mod:`launch.sglang_versions`); a prefix of one is fine (SGLang's parser takes abbreviations). Values are
    left to SGLang's parser: its error is reported as the engine's."""
    if not known:
        return []
    problems = []
    for arg in engine.extra_args:
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        if any(name.startswith(flag) for name in known):
            continue
        close = difflib.get_close_matches(flag, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        problems.append(f"extra_args: {flag}: SGLang {sglang} has no such flag{hint}")
    return problems
