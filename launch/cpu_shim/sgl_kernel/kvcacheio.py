"""``sgl_kernel.kvcacheio`` of the CPU stand-in: host-memory KV cache transfers (hierarchical cache).

SGLang 0.5.10 imports these at module level (``mem_cache/memory_pool_host.py``) whatever the device; a CPU
engine without ``--enable-hierarchical-cache`` never calls them. Each fails loudly when called.
"""

from __future__ import annotations

from typing import Any

from sgl_kernel import _missing


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(f"kvcacheio.{name}")
