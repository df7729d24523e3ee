"""Copy a child process's output to its log file, line by line, with its API key redacted.

The engine and the router print their arguments at start-up (the key among them): the file is owner-only
and the key never reaches it, nor the in-memory tail the caller keeps from ``on_line``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

REDACTED = "<redacted>"


def pump_output(stream: IO[bytes], log_file: Path, *, secret: str | None, on_line: Callable[[str], None]) -> None:
    """Until ``stream`` ends: each line, ``secret`` replaced, to ``log_file`` (created 0600) and to ``on_line``."""
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w", encoding="utf-8", errors="replace") as sink:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip()
            if secret and secret in line:
                line = line.replace(secret, REDACTED)
            sink.write(line + "\n")
            sink.flush()
            on_line(line)
    stream.close()
