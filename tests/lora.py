"""Tiny LoRA adapters for the tiny model, made offline in the PEFT format (``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A/lora_B.weight``, what ``peft`` saves), with
random non-zero weights; and the reference answer of a base model with an adapter: ``transformers`` greedy
decoding on the base weights merged with the adapter (``W + lora_alpha / r * B @ A``, what ``peft``'s
``merge_and_unload`` computes), to compare with the engine's answer token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 8, 16


def _shapes(config: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module of the tiny Qwen2 model."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter = hidden // heads, config["intermediate_size"]
    return {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip


def _module(layer: int, name: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if name in ATTENTION else 'mlp'}.{name}"


def make_adapter(model_dir: Path, out: Path, seed: int, scale: float = 0.2) -> Path:
    """A rank-8 adapter on every attention and MLP projection of every layer, weights ~ N(0, scale)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in _shapes(config).items():
            key = f"base_model.model.{_module(layer, name)}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=generator) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=generator) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
        "target_modules": [*ATTENTION, *MLP], "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "base_model_name_or_path": str(model_dir),
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out


def greedy_ids(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, adapter: Path | None = None) -> list[int]:
    """``transformers``' greedy continuation (float32) of the base model, merged with ``adapter`` when given."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        weights = load_file(str(adapter / "adapter_model.safetensors"))
        settings = json.loads((adapter / "adapter_config.json").read_text())
        scaling = settings["lora_alpha"] / settings["r"]
        modules = dict(model.named_modules())
        with torch.no_grad():
            for key in weights:
                if key.endswith(".lora_A.weight"):
                    module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                    delta = weights[key.replace("lora_A", "lora_B")] @ weights[key]
                    modules[module].weight += scaling * delta
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()
