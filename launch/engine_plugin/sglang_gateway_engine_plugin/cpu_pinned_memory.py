"""On a CPU engine, "pinned" host memory means nothing (there is no GPU to copy to), and torch refuses it.

SGLang 0.5.23's LoRA layers and its torch_native LoRA backend ask for pinned tensors
(``torch.tensor(..., pin_memory=True)``, ``tensor.pin_memory()``) whatever the device, so LoRA fails on the
CPU engine with "Found no NVIDIA driver on your system". On an engine started with ``device: cpu`` and LoRA on
(``SGLANG_GATEWAY_CPU_LORA=1``, set by the launcher) and no CUDA, these become plain tensors; elsewhere nothing
changes (torch's factories stay torch's own).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

CPU_LORA_ENV = "SGLANG_GATEWAY_CPU_LORA"
FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like")


def register() -> None:
    if os.environ.get(CPU_LORA_ENV) != "1":
        return
    import torch

    if torch.cuda.is_available():
        return
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    for name in FACTORIES:
        setattr(torch, name, _unpinned(getattr(torch, name)))


def _unpinned(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def make(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return factory(*args, **kwargs)

    return make
