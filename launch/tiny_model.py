"""Build a tiny, deterministic Qwen2 chat model offline, for the CPU engine and the tests.

Two layers, hidden size 128, a byte-level BPE tokenizer trained on a few sentences and a ChatML
chat template: big enough to exercise SGLang end to end, small enough to build in seconds with no
download. Weights are random (seeded), so outputs are arbitrary text: assert structure, not content.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "Hello! How can I help you today?",
    "The quick brown fox jumps over the lazy dog.",
    "SGLang serves large language models quickly on GPUs and, slowly, on CPUs.",
    "An OpenAI-compatible gateway routes chat completions to inference engines.",
    "MLflow logs models, parameters, metrics and traces for machine learning projects.",
    '{"name": "Alice", "age": 30, "city": "Tokyo", "ok": true, "items": [1, 2, 3]}',
    "Databricks Model Serving runs models behind a REST endpoint with streaming answers.",
    "system user assistant: please answer in JSON with the keys sentiment and score.",
    "0123456789 +-*/=()[]{}<>.,;:!?'\"_ abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]
MARKER_FILE = "sglang_gateway_tiny_model.json"
BUILD_VERSION = 1


def is_built(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` holds a complete build of the current version."""
    marker = Path(out_dir) / MARKER_FILE
    try:
        return json.loads(marker.read_text()).get("version") == BUILD_VERSION
    except (OSError, ValueError):
        return False


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, force: bool = False) -> Path:
    """Write the tiny model to ``out_dir`` (idempotent: an up-to-date build is left alone)."""
    out = Path(out_dir)
    if not force and is_built(out):
        return out
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.model_max_length = 2048
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.1,  # 0.02 makes greedy decoding repeat one token forever
        tie_word_embeddings=True,
        bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    (out / MARKER_FILE).write_text(json.dumps({"version": BUILD_VERSION, "seed": seed}))
    return out
