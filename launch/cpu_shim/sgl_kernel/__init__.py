"""CPU stand-in for ``sgl_kernel`` (SGLang's native kernels).

PyPI only publishes CUDA builds of ``sgl_kernel``; SGLang imports two CPU ops from it at module
level even for dense models on the ``torch_native`` attention backend. This module implements
exactly those two in plain torch and fails loudly for anything else.

It is put on the *engine process's* ``PYTHONPATH`` by ``launch.argv`` only when no real
``sgl_kernel`` is importable there. Never import it from the gateway or the tests' own process.
"""

from __future__ import annotations

import ctypes
from typing import Any, NoReturn

import torch

__version__ = "0.0.0+cpu-shim"
IS_SGLANG_GATEWAY_CPU_SHIM = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request->token table."""
    del pool_len  # implied by req_to_token's shape
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=False):
        length = end - start
        if length > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + length].to(req_to_token.dtype)
        offset += length


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV rows ``src_loc -> tgt_loc`` in every layer buffer (given as raw pointers).

    Reads every source row before writing any target, so overlapping locations are safe,
    like the tiled Triton kernel it replaces.
    """
    sources = src_loc.tolist()
    targets = tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + src * stride, stride) for src in sources]
        for tgt, row in zip(targets, rows, strict=True):
            ctypes.memmove(base + tgt * stride, row, stride)


def _missing(name: str) -> Any:
    def unavailable(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in the sglang-gateway CPU stand-in; "
            "this model or feature needs a real sgl_kernel build"
        )

    unavailable.__name__ = name
    return unavailable


def __getattr__(name: str) -> Any:
    """Let module-level imports of other ops succeed, but fail the moment one is called."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
