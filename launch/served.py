"""What the server processes the project runs have in common, as Protocols.

Three classes run servers: :class:`~launch.process.EngineProcess` (an engine this process launched),
:class:`~launch.shared.SharedEngine` (one engine shared by every process of a machine) and
:class:`~launch.router.RouterProcess` (SGLang's router). Code that takes any of them names the Protocol
that says what it relies on, instead of a union kept in step by convention (``tests/launch/test_served.py``
checks each class against these).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class ServerProcess(Protocol):
    """A supervised server: where it answers and whether it runs."""

    @property
    def url(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def running(self) -> bool: ...


@runtime_checkable
class EngineServer(ServerProcess, Protocol):
    """An SGLang engine a client calls, with the engine's own key (launched here or shared between processes)."""

    api_key: str | None
    port: int | None
    log_file: Path | None

    def auth_headers(self) -> dict[str, str]: ...


@runtime_checkable
class LaunchedServer(ServerProcess, Protocol):
    """A server this process launched and stops: its exit code and the tail of its log (the watchdog's view)."""

    @property
    def returncode(self) -> int | None: ...

    def log_tail(self, lines: int = 40) -> list[str]: ...

    def stop(self, grace_s: float = ...) -> int | None: ...
