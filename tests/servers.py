"""Run a server command the way a user runs it, for tests: ``sglang-gateway launch|serve``, ``mlflow models serve``.

The command leads its own process group and dies with the test process (parent-death signal), its
output goes to a log file, and it is stopped by signalling its group (SIGTERM, then SIGKILL), so
whatever it forked (engines) is stopped too. ``{port}`` in the command line is replaced by a free port.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from launch.ports import pick_free_port
from launch.procgroup import popen_group, stop_group
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "gateway.cli"]


class ServerProcess:
    """One server subprocess in its own process group, logging to ``log_path``."""

    def __init__(
        self, argv: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None, cwd: Path = REPO, port: int | None = None
    ) -> None:
        self.port = port or pick_free_port()  # ``port``: a given one (a server started again where it was)
        self.argv = [arg.replace("{port}", str(self.port)) for arg in argv]
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log_path, "wb") as log:
            self.proc = popen_group(
                self.argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self, last_chars: int | None = None) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-last_chars:] if last_chars else text

    def wait_until(self, predicate: Callable[[], object], timeout_s: float, what: str) -> object:
        """Poll ``predicate`` until it returns something truthy; fail (with the log tail) if the server exits."""

        def while_running() -> object:
            result = predicate()
            if not result and self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.argv[:4]} exited with code {self.proc.returncode} before {what}:\n{self.log(3000)}"
                )
            return result

        return wait_until(while_running, lambda: f"{self.argv[:4]}: no {what}:\n{self.log(3000)}", timeout_s, every_s=0.25)

    def wait_http(self, path: str, timeout_s: float = 300) -> None:
        """Until ``GET path`` answers 200."""

        def answers() -> bool:
            try:
                return httpx.get(self.url + path, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        self.wait_until(answers, timeout_s, f"200 from {path}")

    def wait_log(self, pattern: str, timeout_s: float = 300) -> re.Match[str]:
        """Until the log has a line matching ``pattern``; returns the match."""
        regex = re.compile(pattern)
        match = self.wait_until(lambda: regex.search(self.log()), timeout_s, f"log line {pattern!r}")
        assert isinstance(match, re.Match)
        return match

    def stop(self, sig: signal.Signals = signal.SIGTERM, grace_s: float = 60) -> int | None:
        """``sig`` to the whole group, SIGKILL after ``grace_s``; the exit code of the command."""
        return stop_group(self.proc, grace_s, first=sig, label=" ".join(self.argv[:4]))


@contextmanager
def server_process(
    argv: Sequence[str],
    *,
    log_path: Path,
    env: dict[str, str] | None = None,
    ready_path: str | None = None,
    timeout_s: float = 300,
) -> Iterator[ServerProcess]:
    """Start ``argv`` (waiting for ``ready_path`` to answer 200 if given); stop its group at the end."""
    server = ServerProcess(argv, log_path=log_path, env=env)
    try:
        if ready_path is not None:
            server.wait_http(ready_path, timeout_s)
        yield server
    finally:
        server.stop()
