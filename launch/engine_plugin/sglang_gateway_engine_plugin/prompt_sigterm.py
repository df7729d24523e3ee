"""An engine that is told to stop (SIGTERM) starts its clean shutdown within a fifth of a second, not 0-5 s later.

SGLang 0.5.23's handler only sets a flag (``TokenizerManager.gracefully_exit``), and its
``sigterm_watchdog`` notices the flag on a 5-second sleep loop: every stop (a swap's old engine, an idle
model put to sleep, the end of a test) waited 2.5 s on average for nothing. This AROUND hook watches the
same flag every ``POLL_S`` and then runs SGLang's own watchdog, which finds the flag set and goes straight to
its drain (requests still running are waited for, as before), its ``ShutdownReq`` to the schedulers (the
clean release of GPU memory) and its exit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.sigterm_watchdog"
POLL_S = 0.2


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, watch_sigterm_promptly, HookType.AROUND)


async def watch_sigterm_promptly(
    original: Callable[..., Coroutine[Any, Any, Any]], manager: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``sigterm_watchdog``: wait for the flag at ``POLL_S``, then SGLang's watchdog does the rest."""
    while not manager.gracefully_exit:
        await asyncio.sleep(POLL_S)
    return await original(manager, *args, **kwargs)
