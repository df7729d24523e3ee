"""Where the bytes of batch files live: one small interface, a directory under ``state_dir`` behind it.

An object store is a later option: it would implement the same four calls. Files are written whole to a temporary
name, flushed to disk and renamed, so a file that exists is complete (a SIGKILL mid-upload leaves only a temporary).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

CHUNK = 1024 * 1024


class FileStorage(Protocol):
    """The bytes of a file by id: written once, read (whole or line by line), deleted."""

    def write(self, file_id: str, source: BinaryIO | bytes) -> int: ...
    def open(self, file_id: str) -> BinaryIO: ...
    def delete(self, file_id: str) -> None: ...
    def path(self, file_id: str) -> Path: ...


class LocalFiles:
    """Files as ``<root>/<id>.jsonl`` (mode 0600, the directory 0700: they hold tenants' prompts and answers)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not file_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / f"{file_id}.jsonl"

    def write(self, file_id: str, source: BinaryIO | bytes) -> int:
        """Write ``source`` as ``file_id``; its size in bytes."""
        final = self.path(file_id)
        temporary = final.with_name(f".{final.name}.{secrets.token_hex(4)}.part")
        size = 0
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in _chunks(source):
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, final)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return size

    def open(self, file_id: str) -> BinaryIO:
        return open(self.path(file_id), "rb")

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)


def _chunks(source: BinaryIO | bytes) -> Iterator[bytes]:
    if isinstance(source, bytes):
        yield source
        return
    while chunk := source.read(CHUNK):
        yield chunk


def jsonl_lines(stream: BinaryIO) -> Iterator[tuple[int, int, bytes]]:
    """(index, number, line) of each non-blank line: the index counts non-blank lines from 0 (how batch lines are
    numbered at validation and at run time alike), the number is the line's own in the file, from 1 (what errors name)."""
    index = 0
    for number, raw in enumerate(stream, start=1):
        line = raw.strip()
        if line:
            yield index, number, line
            index += 1
